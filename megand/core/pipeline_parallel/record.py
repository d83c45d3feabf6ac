"""What a pipeline schedule is: one record holding everything known about it.

A schedule is, per pipeline rank, an ordered list of passes ``(kind, chunk, microbatch)``: a forward
(``F``) or a backward (``B``: input and weight gradients together) of one model chunk on one
micro-batch; a zero-bubble schedule splits the backward into its input-gradient pass (``I``: what the
previous stage waits for) and its weight-gradient pass (``W``: waited for by nobody). Which virtual
stage each rank's chunks hold is the schedule's :class:`Placement`.

:class:`PipelineSchedule` is the record every reader consults (configuration checks, the executor,
``Topology``, the memory estimator, the planner, the docs): its order and evaluation order, its
placement, the chunks per rank and pipeline size it needs, its micro-batch rule and whether it splits
the backward. The registered records are listed in ``orders/__init__.py`` (one file per schedule) and
looked up through ``registry.py``; no reader compares a schedule's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

FORWARD, BACKWARD = "F", "B"  # kinds; BACKWARD is the full backward (input and weight gradients)
INPUT_GRAD, WEIGHT_GRAD = "I", "W"  # the backward split: input gradients (sent on), weight gradients (local)


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

    @property
    def last_rank(self) -> int:
        """The pipeline rank holding the last virtual stage (the output layer and the loss)."""
        return self.location(self.num_stages - 1)[0]

    def stages_of(self, rank: int) -> list:
        """The virtual stages rank ``rank`` holds, chunk by chunk."""
        return [self.stage(rank, chunk) for chunk in range(self.vpp)]


def interleaved_placement(pp: int, vpp: Optional[int] = 1) -> Placement:
    """Megatron's interleaving: chunk ``c`` of rank ``r`` is virtual stage ``c*pp + r``, so consecutive
    virtual stages live on consecutive ranks (the last rank's chunk c feeds the first rank's chunk c+1).
    With one chunk per rank it is plain pipelining: rank r is stage r."""
    vpp = vpp or 1
    return Placement(pp, vpp, lambda rank, chunk: chunk * pp + rank, lambda stage: (stage % pp, stage // pp))


def v_placement(pp: int, vpp: Optional[int] = 2) -> Placement:
    """The V (two chunks per rank): chunk 0 of rank r is virtual stage r, chunk 1 is stage
    ``2·pp - 1 - r``, so the pipeline runs down the ranks and back up; the last rank hands its chunk 0's
    output to its own chunk 1, and rank 0 holds both the first stage and the last (the loss)."""
    return Placement(pp, 2, lambda rank, chunk: rank if chunk == 0 else 2 * pp - 1 - rank,
                     lambda stage: (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1))


@dataclass(frozen=True)
class MicrobatchRule:
    """The micro-batches per step a schedule runs: at least ``minimum`` (``minimum_is`` says how it is
    derived, e.g. ``2*pp = 8``), a multiple of ``multiple``, the size of the dimension ``multiple_of``
    (e.g. ``pp``); ``who`` names the rule in messages."""

    who: str
    minimum: int = 1
    minimum_is: str = "1"
    multiple: int = 1
    multiple_of: str = ""

    def error(self, m: int, counted: Optional[str] = None, keys: str = "") -> Optional[str]:
        """Why ``m`` micro-batches per step cannot run (``counted``: how they were counted; ``keys``: the
        config group the dimension is named with, ``parallel.`` in configuration messages), or None."""
        counted = counted or f"{m}"
        if m < self.minimum:
            return f"{self.who} needs at least {self.minimum_is} micro-batches per step, got {counted}"
        if m % self.multiple:
            return (f"{self.who} needs the number of micro-batches ({counted}) to be a multiple of "
                    f"{keys}{self.multiple_of}={self.multiple}")
        return None

    def ramp_error(self, m: int, size: int, ramp: list) -> Optional[str]:
        """The same for a step of a batch ramp-up (``train.rampup_batch_size=ramp``) reaching ``size``."""
        reaches = f"train.rampup_batch_size={ramp} reaches a global batch of {size}: {m} micro-batches"
        if m < self.minimum:
            return f"{reaches}, fewer than the {self.minimum_is} that {self.who} needs"
        if m % self.multiple:
            return f"{reaches}, not a multiple of parallel.{self.multiple_of}={self.multiple} ({self.who})"
        return None

    def smallest_at_least(self, m: int) -> int:
        """The fewest micro-batches this rule runs that are at least ``m``."""
        m = max(m, self.minimum)
        return m + (-m) % self.multiple


@dataclass(frozen=True)
class PipelineSchedule:
    """One pipeline schedule (a value of ``parallel.pp_schedule``).

    ``order(pp, vpp, rank, m)``: rank ``rank``'s passes ``[(kind, chunk, microbatch), ...]`` for one
    training step (pp >= 2; ``vpp`` the chunks per rank, None for one). ``eval_order``: the same for an
    evaluation step (forwards only); None: the forwards of ``order``. ``placement(pp, vpp)``: which
    virtual stage each rank's chunks hold. ``chunks``: the model chunks per rank it runs (None: any,
    ``parallel.vpp`` free), with at least ``min_pp`` ranks; ``needs`` says so in its refusal.
    ``microbatches(pp, vpp)``: its :class:`MicrobatchRule`. ``splits_backward``: its backwards run as
    ``I`` then ``W``. ``title``, ``summary``: its display name and one line for the docs. ``bubble(pp,
    vpp, m, f, i, w)``: its closed-form idle fraction of the step from a micro-batch's forward, input- and
    weight-gradient times on a rank, and the formula written out; None where the replay is the only
    prediction."""

    name: str
    title: str
    summary: str
    order: Callable[[int, Optional[int], int, int], list]
    placement: Callable[[int, Optional[int]], Placement] = interleaved_placement
    chunks: Optional[int] = None
    min_pp: int = 1
    needs: str = ""
    microbatches: Optional[Callable[[int, Optional[int]], MicrobatchRule]] = None
    splits_backward: bool = False
    eval_order: Optional[Callable[[int, Optional[int], int, int], list]] = None
    bubble: Optional[Callable[..., tuple]] = None

    def layout_error(self, pp: int, vpp: Optional[int]) -> Optional[str]:
        """Why this schedule cannot run ``pp`` ranks of ``vpp`` chunks each, or None."""
        if self.chunks is None:
            if vpp is not None and (pp < 2 or vpp < 1):
                return f"parallel.vpp={vpp} needs parallel.pp >= 2 (got {pp}) and vpp >= 1"
            return None
        if pp < self.min_pp or (vpp or 1) != self.chunks:
            return f"parallel.pp_schedule={self.name} {self.needs} (got pp={pp}, vpp={vpp})"
        return None

    def microbatch_rule(self, pp: int, vpp: Optional[int]) -> MicrobatchRule:
        if self.microbatches is None:
            return MicrobatchRule(who=f"parallel.pp_schedule={self.name}")
        return self.microbatches(pp, vpp)

    def error(self, pp: int, vpp: Optional[int], m: int, counted: Optional[str] = None) -> Optional[str]:
        """Why this schedule cannot run ``pp`` ranks of ``vpp`` chunks on ``m`` micro-batches per step
        (``counted``: how they were counted), or None; the configuration's message."""
        return self.layout_error(pp, vpp) or self.microbatch_rule(pp, vpp).error(m, counted, keys="parallel.")

    def forward_order(self, pp: int, vpp: Optional[int], rank: int, m: int) -> list:
        """Rank ``rank``'s passes of an evaluation step: forwards only."""
        if self.eval_order is not None:
            return self.eval_order(pp, vpp, rank, m)
        return [step for step in self.order(pp, vpp, rank, m) if step[0] == FORWARD]
