"""Pipeline schedules as action lists: the one description of what every rank runs, in which order.

A schedule is, per pipeline rank, the ordered list of its :class:`Action` s: a forward (``F``) or a
backward (``B``, the full backward: input and weight gradients together) of one model chunk on one
micro-batch, with whether its input arrives from another rank and whether its output leaves for one
(and which). The executor (schedules.py) runs these lists, the planner replays them on measured times
(megand/tools/planner/simulate.py) and the memory estimator counts the activations they keep alive
(:func:`peak_live_chunks`), so an order is written once, here.

Which rank and chunk hold a virtual stage is the placement's job (:class:`Placement`); a schedule
only names its actions by chunk and micro-batch. A schedule that splits the backward into its input-
and weight-gradient passes adds action kinds next to ``B``; one with another placement (a V that puts a
rank's two chunks at both ends of the pipeline) adds a placement function.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional

FORWARD, BACKWARD = "F", "B"  # kinds; BACKWARD is the full backward (input and weight gradients)


@dataclass(frozen=True)
class Placement:
    """Where the virtual stages live: ``stage(rank, chunk)`` and its inverse ``location(stage)``,
    over ``pp`` ranks with ``vpp`` chunks each."""

    pp: int
    vpp: int
    stage: Callable[[int, int], int]
    location: Callable[[int], tuple]

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp


def interleaved_placement(pp: int, vpp: int = 1) -> Placement:
    """Megatron's interleaving: chunk ``c`` of rank ``r`` is virtual stage ``c*pp + r``, so consecutive
    virtual stages live on consecutive ranks (the last rank's chunk c feeds the first rank's chunk c+1).
    With one chunk per rank it is plain pipelining: rank r is stage r."""
    return Placement(pp, vpp, lambda rank, chunk: chunk * pp + rank, lambda stage: (stage % pp, stage // pp))


@dataclass(frozen=True)
class Action:
    """One compute of a rank, with its communication.

    ``recv_from``: the pipeline rank this action's input comes from (the activation of the previous
    virtual stage for a forward, the gradient of the next one's input for a backward), None where the
    rank has it already (the first stage reads its micro-batch, the last stage's backward starts from
    its loss). ``send_to``: the pipeline rank its output goes to, None where none does.
    """

    kind: str
    chunk: int
    microbatch: int
    stage: int  # virtual stage: placement.stage(rank, chunk)
    recv_from: Optional[int] = None
    send_to: Optional[int] = None

    @property
    def key(self) -> tuple:
        """``(kind, virtual stage, micro-batch)``: how the planner's replay and the traces name it."""
        return self.kind, self.stage, self.microbatch


def _with_peers(order, placement: Placement, rank: int) -> list:
    """Actions from ``[(kind, chunk, microbatch), ...]``: stages and peers from the placement."""
    last = placement.num_stages - 1
    actions = []
    for kind, chunk, microbatch in order:
        stage = placement.stage(rank, chunk)
        before = placement.location(stage - 1)[0] if stage > 0 else None
        after = placement.location(stage + 1)[0] if stage < last else None
        if kind == FORWARD:
            actions.append(Action(kind, chunk, microbatch, stage, recv_from=before, send_to=after))
        else:
            actions.append(Action(kind, chunk, microbatch, stage, recv_from=after, send_to=before))
    return actions


def no_pipelining_order(m: int) -> list:
    """pp = 1 (gradient accumulation): forward then backward of each micro-batch in turn."""
    return [(kind, 0, i) for i in range(m) for kind in (FORWARD, BACKWARD)]


def one_f_one_b_order(pp: int, rank: int, m: int, num_warmup: Optional[int] = None) -> list:
    """1F1B: ``pp - rank - 1`` warm-up forwards, then one forward and one backward, then the remaining
    backwards; stage 0 holds at most pp micro-batches. ``num_warmup=m`` is fill-drain (GPipe)."""
    warmup = min(pp - rank - 1, m) if num_warmup is None else num_warmup
    order = [(FORWARD, 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [(FORWARD, 0, warmup + i), (BACKWARD, 0, i)]
    return order + [(BACKWARD, 0, i) for i in range(m - warmup, m)]


def interleaved_order(pp: int, vpp: int, rank: int, m: int) -> list:
    """Megatron's interleaved 1F1B over ``vpp`` chunks per rank. Step k of the rank's forwards (and of
    its backwards) works on micro-batch ``(k // (pp·vpp))·pp + k % pp`` of chunk ``(k // pp) % vpp``
    (backwards: the chunks reversed), i.e. groups of pp micro-batches run through chunk 0, then chunk
    1, ...; ``2·(pp - rank - 1) + (vpp - 1)·pp`` warm-up forwards (all of them when m == pp)."""
    if m % pp:
        raise ValueError(f"interleaved pipelining needs the number of micro-batches ({m}) to be a multiple of pp={pp}")
    total = m * vpp
    warmup = total if m == pp else min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)

    def step(k, kind):
        chunk = (k % (pp * vpp)) // pp
        return kind, chunk if kind == FORWARD else vpp - 1 - chunk, (k // (pp * vpp)) * pp + k % pp

    order = [step(k, FORWARD) for k in range(warmup)]
    for k in range(total - warmup):
        order += [step(warmup + k, FORWARD), step(k, BACKWARD)]
    return order + [step(k, BACKWARD) for k in range(total - warmup, total)]


def schedule_actions(pp: int, vpp: Optional[int], m: int, rank: int, fill_drain: bool = False,
                     forward_only: bool = False) -> list:
    """The actions of pipeline rank ``rank`` for one step of ``m`` micro-batches: no pipelining (pp=1),
    1F1B (or fill-drain), or interleaved 1F1B (vpp > 1). ``forward_only``: the same forwards, no backward."""
    v = vpp or 1
    if pp == 1:
        order = no_pipelining_order(m)
    elif v > 1:
        order = interleaved_order(pp, v, rank, m)
    else:
        order = one_f_one_b_order(pp, rank, m, num_warmup=m if fill_drain else None)
    actions = _with_peers(order, interleaved_placement(pp, v if pp > 1 else 1), rank)
    return [a for a in actions if a.kind == FORWARD] if forward_only else actions


def live_chunks(actions) -> int:
    """The most chunk forwards this action list holds at once (run, their backward not yet)."""
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == FORWARD else -1
        peak = max(peak, live)
    return peak


@lru_cache(maxsize=4096)
def peak_live_chunks(pp: int, vpp: Optional[int], m: int, rank: int) -> int:
    """:func:`live_chunks` of rank ``rank``'s schedule (cached: the planner asks it for many layouts)."""
    return live_chunks(schedule_actions(pp, vpp, m, rank))
