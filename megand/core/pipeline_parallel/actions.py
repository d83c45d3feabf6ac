"""Pipeline schedules as action lists: the one description of what every rank runs, in which order.

A schedule is, per pipeline rank, the ordered list of its :class:`Action` s: a forward (``F``) or a
backward (``B``, the full backward: input and weight gradients together) of one model chunk on one
micro-batch, with whether its input arrives from another rank and whether its output leaves for one
(and which). The executor (schedules.py) runs these lists, the planner replays them on measured times
(megand/tools/planner/simulate.py) and the memory estimator counts the activations they keep alive
(:func:`peak_live_chunks`), so an order is written once, here.

Which rank and chunk hold a virtual stage is the placement's job (:class:`Placement`); a schedule
only names its actions by chunk and micro-batch. A zero-bubble schedule splits the backward into
its input-gradient pass (``I``: what the previous stage waits for) and its weight-gradient pass (``W``:
waited for by nobody, so it can fill the time a rank would idle); the executor runs ``I`` with the
weight-gradient products of the parallel linear layers queued and ``W`` runs them. A schedule with
another placement (a V that puts a rank's two chunks at both ends of the pipeline) adds a placement
function.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional

FORWARD, BACKWARD = "F", "B"  # kinds; BACKWARD is the full backward (input and weight gradients)
INPUT_GRAD, WEIGHT_GRAD = "I", "W"  # the backward split: input gradients (sent on), weight gradients (local)

SCHEDULES = ("1f1b", "zb1p", "zbv", "dualpipev")  # parallel.pp_schedule

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


def v_placement(pp: int) -> Placement:
    """The V of ZB-V and DualPipeV (two chunks per rank): chunk 0 of rank r is virtual stage r, chunk 1
    is stage ``2·pp - 1 - r``, so the pipeline runs down the ranks and back up; the last rank hands its
    chunk 0's output to its own chunk 1, and rank 0 holds both the first stage and the last (the loss)."""
    return Placement(pp, 2, lambda rank, chunk: rank if chunk == 0 else 2 * pp - 1 - rank,
                     lambda stage: (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1))


V_SCHEDULES = ("zbv", "dualpipev")


def placement_for(pp: int, vpp: Optional[int], schedule: str = "1f1b") -> Placement:
    """The placement a schedule runs on: the V for ``zbv`` and ``dualpipev``, else Megatron's interleaving."""
    if schedule in V_SCHEDULES:
        return v_placement(pp)
    return interleaved_placement(pp, vpp or 1)


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
        elif kind == WEIGHT_GRAD:  # the weight gradients of a backward whose input gradient has left
            actions.append(Action(kind, chunk, microbatch, stage))
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


@lru_cache(maxsize=256)
def zero_bubble_h1_orders(pp: int, m: int) -> tuple:
    """ZB-H1 (one chunk per rank): every rank's order, made by running the pipeline on unit times
    (F = I = W = 1) and letting each rank, whenever it is free, take the first of: an ``I`` whose
    gradient has arrived (the critical path: the previous stage waits for it), an ``F`` whose input has
    arrived while it holds fewer than 1F1B's ``pp - rank`` forwards awaiting their ``I``, then its oldest
    pending ``W``; a rank with more than ``pp - 1`` weight-gradient passes pending runs the oldest first.

    1F1B idles ``(p-1)(F+I+W)`` per rank; here the cool-down's waits between input gradients are filled
    with the deferred ``W`` passes, which leaves ``(p-1)·F`` (a third of 1F1B's bubble at equal
    times). The price: up to ``pp - 1`` micro-batches' weight-gradient operands (each linear layer's
    input and output gradient) held next to 1F1B's activations."""
    orders = [[] for _ in range(pp)]
    forwards, input_grads, weight_grads = [0] * pp, [0] * pp, [0] * pp
    forward_done, input_done = {}, {}  # (rank, micro-batch) -> unit time its result is there
    free_at, now, never = [0] * pp, 0, float("inf")
    while any(w < m for w in weight_grads):
        for r in range(pp):
            if free_at[r] > now:
                continue
            i, f = input_grads[r], forwards[r]
            source = forward_done.get((r, i), never) if r == pp - 1 else input_done.get((r + 1, i), never)
            if input_grads[r] - weight_grads[r] > pp - 1:
                step = WEIGHT_GRAD, weight_grads[r]
            elif i < f and source <= now:
                step = INPUT_GRAD, i
            elif f < m and f - i < pp - r and (r == 0 or forward_done.get((r - 1, f), never) <= now):
                step = FORWARD, f
            elif weight_grads[r] < input_grads[r]:
                step = WEIGHT_GRAD, weight_grads[r]
            else:
                continue
            kind, microbatch = step
            orders[r].append((kind, 0, microbatch))
            free_at[r] = now + 1
            if kind == FORWARD:
                forwards[r] += 1
                forward_done[(r, microbatch)] = now + 1
            elif kind == INPUT_GRAD:
                input_grads[r] += 1
                input_done[(r, microbatch)] = now + 1
            else:
                weight_grads[r] += 1
        now += 1
    return tuple(tuple(order) for order in orders)


def zbv_order(pp: int, rank: int, m: int) -> list:
    """ZB-V (the zero-bubble paper's V schedule) on :func:`v_placement`: chunk 0 forwards fill the V,
    then chunk 1's forwards join, each chunk-1 forward followed by its input and weight gradient; the
    steady state runs F0 I0 W0 F1 I1 W1; the cool-down runs input gradients first and moves the weight
    gradients into the waits. Built for ``max(m, 2·pp - 1)`` micro-batches (its warm-up assumes a full
    V), the extra ones dropped."""
    n = max(m, 2 * pp - 1)
    order, count = [], {(k, c): 0 for k in (FORWARD, INPUT_GRAD, WEIGHT_GRAD) for c in (0, 1)}

    def emit(kind, chunk):
        order.append((kind, chunk, count[(kind, chunk)]))
        count[(kind, chunk)] += 1

    for _ in range(2 * (pp - rank) - 1):
        emit(FORWARD, 0)
    for _ in range(rank):
        emit(FORWARD, 1)
        emit(FORWARD, 0)
    for _ in range(pp - rank):
        emit(FORWARD, 1)
        emit(INPUT_GRAD, 1)
        emit(WEIGHT_GRAD, 1)
    while count[(FORWARD, 1)] < count[(FORWARD, 0)] or count[(FORWARD, 0)] < n:
        if count[(FORWARD, 0)] < n:
            emit(FORWARD, 0)
        emit(INPUT_GRAD, 0)
        emit(WEIGHT_GRAD, 0)
        emit(FORWARD, 1)
        emit(INPUT_GRAD, 1)
        emit(WEIGHT_GRAD, 1)
    for _ in range(rank):
        emit(INPUT_GRAD, 0)
        emit(INPUT_GRAD, 1)
    for _ in range(pp - rank):
        emit(INPUT_GRAD, 0)
        emit(WEIGHT_GRAD, 0)
    for chunk in (1, 0):
        while count[(WEIGHT_GRAD, chunk)] < count[(INPUT_GRAD, chunk)]:
            emit(WEIGHT_GRAD, chunk)
    return [step for step in order if step[2] < m]


def dualpipev_order(pp: int, rank: int, m: int) -> list:
    """DualPipeV (DeepSeek's DualPipe folded into a V, as torchtitan runs it) on :func:`v_placement`:
    chunk 0 forwards fill the V, chunk-1 input gradients with their weight gradients meet chunk-1
    forwards, then the main phase pairs each forward of one chunk with a full backward of the other
    (which a GPU overlaps: one's compute hides the other's communication; here they run one after the
    other), and the cool-down splits the last backwards into I and W to fill its waits. Needs
    ``m >= 2·pp`` micro-batches."""
    if m < 2 * pp:
        raise ValueError(f"pipeline schedule dualpipev needs at least 2*pp = {2 * pp} micro-batches per step, got {m}")
    order, forwards, backwards, pending = [], [0, 0], [0, 0], []

    def forward(chunk):
        order.append((FORWARD, chunk, forwards[chunk]))
        forwards[chunk] += 1

    def backward(chunk, split):
        order.append((INPUT_GRAD if split else BACKWARD, chunk, backwards[chunk]))
        if split:
            pending.append((chunk, backwards[chunk]))
        backwards[chunk] += 1

    def weight():
        if pending:
            chunk, microbatch = pending.pop(0)
            order.append((WEIGHT_GRAD, chunk, microbatch))

    for _ in range((pp - rank - 1) * 2):
        forward(0)
    for _ in range(rank + 1):
        forward(0)
        forward(1)
    for _ in range(pp - rank - 1):
        backward(1, split=True)
        weight()
        forward(1)
    for _ in range(m - 2 * pp + rank + 1):
        forward(0)
        backward(1, split=False)
        forward(1)
        backward(0, split=False)
    for _ in range(pp - rank - 1):
        backward(1, split=False)
        forward(1)
        backward(0, split=False)
    split = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        backward(1, split)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        backward(0, split)
    for _ in range(pp - rank - 1):
        weight()
        backward(0, split=True)
    while pending:
        weight()
    return order


def schedule_actions(pp: int, vpp: Optional[int], m: int, rank: int, fill_drain: bool = False,
                     forward_only: bool = False, schedule: str = "1f1b") -> list:
    """The actions of pipeline rank ``rank`` for one step of ``m`` micro-batches: no pipelining (pp=1),
    1F1B (or fill-drain), interleaved 1F1B (vpp > 1), or ``schedule="zb1p"`` (ZB-H1: the backward
    split into ``I`` and ``W``). ``forward_only``: the same forwards, no backward."""
    v = vpp or 1
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if schedule in V_SCHEDULES and (pp == 1 or v != 2 or fill_drain):
        raise ValueError(f"pipeline schedule {schedule} needs pp >= 2 and vpp=2 (its V: two chunks per rank), "
                         f"got pp={pp}, vpp={vpp}")
    if schedule == "zb1p" and (pp == 1 or v > 1 or fill_drain):
        raise ValueError(f"pipeline schedule zb1p needs pp >= 2 and one chunk per rank (got pp={pp}, vpp={vpp})")
    placement = placement_for(pp, v if pp > 1 else 1, schedule)
    if forward_only and schedule in V_SCHEDULES:  # evaluation: each micro-batch down and back up the V
        order = [(FORWARD, chunk, i) for i in range(m) for chunk in (0, 1)]
        return _with_peers(order, placement, rank)
    if forward_only and schedule != "1f1b":  # evaluation: the forwards in the order of 1F1B, no backward
        schedule = "1f1b"
    if pp == 1:
        order = no_pipelining_order(m)
    elif schedule == "zb1p":
        order = list(zero_bubble_h1_orders(pp, m)[rank])
    elif schedule == "zbv":
        order = zbv_order(pp, rank, m)
    elif schedule == "dualpipev":
        order = dualpipev_order(pp, rank, m)
    elif v > 1:
        order = interleaved_order(pp, v, rank, m)
    else:
        order = one_f_one_b_order(pp, rank, m, num_warmup=m if fill_drain else None)
    actions = _with_peers(order, placement, rank)
    return [a for a in actions if a.kind == FORWARD] if forward_only else actions


def live_chunks(actions) -> int:
    """The most chunk forwards this action list holds at once: run, their backward not yet complete
    (a split backward completes with its ``W``: the weight-gradient operands, each linear layer's input
    and output gradient, are held until then; counted as a whole forward, an upper bound)."""
    live = peak = 0
    for action in actions:
        live += {FORWARD: 1, BACKWARD: -1, INPUT_GRAD: 0, WEIGHT_GRAD: -1}[action.kind]
        peak = max(peak, live)
    return peak


@lru_cache(maxsize=4096)
def peak_live_chunks(pp: int, vpp: Optional[int], m: int, rank: int, schedule: str = "1f1b") -> int:
    """:func:`live_chunks` of rank ``rank``'s schedule (cached: the planner asks it for many layouts)."""
    return live_chunks(schedule_actions(pp, vpp, m, rank, schedule=schedule))
