"""Pipeline schedules as action lists: the one description of what every rank runs, in which order.

A schedule (its record: record.py; each schedule's order: orders/) gives, per pipeline rank, the ordered
list of its :class:`Action` s: a forward (``F``) or a backward (``B``, the full backward: input and
weight gradients together) of one model chunk on one micro-batch, with whether its input arrives from
another rank and whether its output leaves for one (and which). The executor (schedules.py) runs
these lists, the planner replays them on measured times (megand/tools/planner/simulate.py) and the
memory estimator counts the activations they keep alive (:func:`peak_live_chunks`), so an order is
written once.

Which rank and chunk hold a virtual stage is the record's placement (:class:`Placement`); a schedule
only names its passes by chunk and micro-batch. A zero-bubble schedule splits the backward into its
input-gradient pass (``I``: what the previous stage waits for) and its weight-gradient pass (``W``:
waited for by nobody, so it can fill the time a rank would idle); the executor runs ``I`` with the
weight-gradient products of the parallel linear layers queued and ``W`` runs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from megand.core.pipeline_parallel.orders.one_f_one_b import FILL_DRAIN, no_pipelining_order
from megand.core.pipeline_parallel.record import (BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Placement,
                                                  interleaved_placement, v_placement)
from megand.core.pipeline_parallel.registry import DEFAULT_SCHEDULE, schedule_record

__all__ = ["BACKWARD", "FORWARD", "INPUT_GRAD", "WEIGHT_GRAD", "Action", "Placement", "interleaved_placement",
           "v_placement", "placement_for", "schedule_actions", "live_chunks", "peak_live_chunks"]


def placement_for(pp: int, vpp: Optional[int], schedule: str = DEFAULT_SCHEDULE) -> Placement:
    """The placement ``parallel.pp_schedule=schedule`` runs on (its record's)."""
    return schedule_record(schedule).placement(pp, vpp)


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


def schedule_actions(pp: int, vpp: Optional[int], m: int, rank: int, fill_drain: bool = False,
                     forward_only: bool = False, schedule: str = DEFAULT_SCHEDULE) -> list:
    """The actions of pipeline rank ``rank`` for one step of ``m`` micro-batches under
    ``parallel.pp_schedule=schedule`` (its record's order; no pipelining when pp=1; ``fill_drain``:
    GPipe, for comparison). ``forward_only``: an evaluation step (the record's forwards, no backward).
    A layout or micro-batch count the record refuses is a ValueError with the config's message."""
    record = FILL_DRAIN if fill_drain else schedule_record(schedule)
    vpp = vpp if pp > 1 and (vpp or 1) > 1 else None
    error = record.layout_error(pp, vpp)
    if error is None and pp > 1 and not (forward_only and record.eval_order is not None):
        error = record.microbatch_rule(pp, vpp).error(m)
    if error:
        raise ValueError(error)
    if pp == 1:
        order = no_pipelining_order(m)
        order = [step for step in order if step[0] == FORWARD] if forward_only else order
        return _with_peers(order, interleaved_placement(1), rank)
    order = record.forward_order(pp, vpp, rank, m) if forward_only else record.order(pp, vpp, rank, m)
    return _with_peers(order, record.placement(pp, vpp), rank)


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
def peak_live_chunks(pp: int, vpp: Optional[int], m: int, rank: int, schedule: str = DEFAULT_SCHEDULE) -> int:
    """:func:`live_chunks` of rank ``rank``'s schedule (cached: the planner asks it for many layouts)."""
    return live_chunks(schedule_actions(pp, vpp, m, rank, schedule=schedule))
