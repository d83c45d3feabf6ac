"""Replay megand's pipeline schedules on per-stage forward/backward times.

Each pipeline rank runs its forwards and backwards in the order of its action list, the one the
executor runs (megand/core/pipeline_parallel/actions.py: 1F1B's ``pp - r - 1`` warm-up forwards, then
one forward and one backward, then the remaining backwards; interleaved: Megatron's chunk order over
groups of pp micro-batches; zero bubble ``zb1p``: each backward split into its input-gradient pass ``I``
and a weight-gradient pass ``W`` placed where the rank would wait; ``zbv`` and ``dualpipev``: the same
on a V of two chunks per rank, whose turn at the last rank sends nothing). An operation starts when its rank is free and its input has arrived: the previous
virtual stage's forward of the same micro-batch (plus the p2p time of that boundary), or the next
virtual stage's backward (``I`` of a split one); a ``W`` follows its own ``I``. The step's pipeline time, each rank's busy time and the bubble come out of
the replay, so uneven stages, interleaving and slow links are accounted as they happen, not by the
equal-stage formula ``(p - 1) / (m + p - 1)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from megand.core.pipeline_parallel.actions import placement_for, schedule_actions
from megand.core.pipeline_parallel.registry import DEFAULT_SCHEDULE, schedule_error, schedule_record


def rank_operations(pp: int, vpp: int | None, m: int, rank: int, schedule: str = DEFAULT_SCHEDULE) -> list:
    """``[(kind, virtual_stage, microbatch), ...]`` in the order rank ``rank`` runs them (kind F, B, or
    I and W): the keys of the action list megand's executor runs (megand/core/pipeline_parallel/actions.py)."""
    vpp = vpp if pp > 1 and (vpp or 1) > 1 else None
    if pp == 1:
        return [action.key for action in schedule_actions(pp, vpp, m, rank, schedule=schedule)]
    # the record's order with each chunk's virtual stage: the action list's keys without building its
    # actions (their peers are the executor's business; the search asks for thousands of these)
    error = schedule_error(schedule, pp, vpp, m)
    if error:
        raise ValueError(error)
    record = schedule_record(schedule)
    stage = record.placement(pp, vpp).stage
    return [(kind, stage(rank, chunk), i) for kind, chunk, i in record.order(pp, vpp, rank, m)]


@dataclass(frozen=True)
class Program:
    """A schedule's replay compiled once per (pp, vpp, m, schedule): which operation runs when depends only
    on which inputs exist, never on the times, so the order the replay settles operations in, and each
    one's input, are fixed; only the arithmetic on the times is left per layout (the search replays the
    same few schedules on thousands of candidates).

    ``ops[i]``: ``(rank, kind, virtual stage, micro-batch, input op or -1, p2p boundary or -1)``, in
    settling order; ``final[r]``: per rank, the ops whose start makes a chunk's gradients final."""

    ops: tuple
    final: tuple


@lru_cache(maxsize=64)  # a 40-stage pipeline of 512 micro-batches is ~40k operations
def compile_program(pp: int, vpp: int | None, m: int, schedule: str = DEFAULT_SCHEDULE) -> Program:
    """An operation settles when its rank is free and its input has arrived: the previous virtual
    stage's forward of the same micro-batch, or the next virtual stage's backward (``I`` of a split
    one); a ``W`` follows its own ``I``."""
    stages = pp * (vpp or 1)
    orders = [rank_operations(pp, vpp, m, r, schedule) for r in range(pp)]
    placement = placement_for(pp, vpp, schedule)
    position, index, ops = [0] * pp, {}, []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            while position[r] < len(orders[r]):
                kind, s, i = orders[r][position[r]]
                link = -1
                if kind == "F":  # the previous virtual stage's output (a V's turn: no link)
                    dep = ("F", s - 1, i) if s > 0 else None
                    if s > 0 and placement.location(s - 1)[0] != r:
                        link = s - 1
                elif kind == "W":
                    dep = ("I", s, i)
                else:
                    dep = ("F", s, i)
                    if s < stages - 1:
                        dep = ("B", s + 1, i) if ("B", s + 1, i) in index else ("I", s + 1, i)
                        if placement.location(s + 1)[0] != r:
                            link = s
                if dep is not None and dep not in index:
                    break
                index[(kind, s, i)] = len(ops)
                ops.append((r, kind, s, i, -1 if dep is None else index[dep], link))
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule replay deadlocked (pp={pp}, vpp={vpp}, m={m}): a bug")
    final = []
    for r in range(pp):  # a chunk's gradients are final during its last micro-batch's backward (split: its W)
        own = [placement.stage(r, c) for c in range(placement.vpp)]
        final.append(tuple(index[("B", s, m - 1)] if ("B", s, m - 1) in index else index[("W", s, m - 1)]
                           for s in own))
    return Program(ops=tuple(ops), final=tuple(final))


@dataclass
class Timeline:
    makespan: float              # first operation's start to the last one's end, over all ranks
    busy: list                   # per rank: seconds spent in forwards and backwards
    finish: list                 # per rank: when its last backward ends
    last_backward: list          # per rank: seconds from the start of the first backward that makes a
                                 # chunk's gradients final (its last micro-batch) to the rank's end: the
                                 # window in which overlapped gradient reduction can hide
    program: Program
    starts: list                 # per operation of the program: its start and its end
    ends: list

    @property
    def ops(self) -> dict:
        """(kind, virtual_stage, microbatch) -> (start, end)."""
        return {(kind, s, i): (a, b) for (_, kind, s, i, _, _), a, b in zip(self.program.ops, self.starts, self.ends)}

    @property
    def bubble_fraction(self) -> float:
        """Mean over ranks of the time a rank waits, as a fraction of the pipeline time."""
        if self.makespan <= 0:
            return 0.0
        return sum(1.0 - b / self.makespan for b in self.busy) / len(self.busy)


WEIGHT_GRAD_SHARE = 0.5  # of a layer's backward: the weight-gradient GEMMs (dW = dy^T x), as many FLOPs as dx


def simulate(pp: int, vpp: int | None, m: int, forward: list, backward: list, p2p=None,
             schedule: str = DEFAULT_SCHEDULE,
             weight_grad: list | None = None) -> Timeline:
    """Replay the schedule. ``forward[s]``/``backward[s]``: seconds of one micro-batch on virtual stage
    ``s`` (``pp * vpp`` entries); ``p2p[s]``: seconds to send an activation (or its gradient) across
    the boundary between virtual stages ``s`` and ``s + 1`` (the sender does not wait for it).
    ``schedule``: ``parallel.pp_schedule``; a split backward's ``W`` takes ``weight_grad[s]`` of
    ``backward[s]`` (default: :data:`WEIGHT_GRAD_SHARE` of it) and its ``I`` the rest."""
    stages = pp * (vpp or 1)
    if len(forward) != stages or len(backward) != stages:
        raise ValueError(f"need {stages} forward and backward times, got {len(forward)} and {len(backward)}")
    p2p = list(p2p) if p2p is not None else [0.0] * max(stages - 1, 0)
    weight_grad = list(weight_grad) if weight_grad is not None else [WEIGHT_GRAD_SHARE * b for b in backward]
    program = compile_program(pp, vpp, m, schedule)
    cost = {"F": forward, "B": backward, "W": weight_grad, "I": [b - w for b, w in zip(backward, weight_grad)]}
    free, busy = [0.0] * pp, [0.0] * pp
    starts, ends = [], []
    for r, kind, s, _, dep, link in program.ops:
        ready = 0.0 if dep < 0 else ends[dep] + (p2p[link] if link >= 0 else 0.0)
        start = free[r] if free[r] > ready else ready
        t = cost[kind][s]
        starts.append(start)
        ends.append(start + t)
        free[r] = start + t
        busy[r] += t
    last_backward = [free[r] - min(starts[i] for i in program.final[r]) for r in range(pp)]
    return Timeline(makespan=max(free), busy=busy, finish=list(free), last_backward=last_backward,
                    program=program, starts=starts, ends=ends)
