"""The parallel layout: the sizes of every parallel dimension, validated and derived once.

:class:`ParallelLayout` is the one immutable value of a layout (tp, pp, cp, dp, vpp, the rank order,
the shard groups, the expert grid and the pipeline schedule whose placement lays the virtual stages on
the ranks). Every rule between the sizes (dp inferred from the world size, dp_shard and ep dividing
dp x cp, etp being 1 or tp, the chunks per rank the schedule runs) is checked here, when the value is
made, and every derived size (the shard group, the expert data-parallel size, the rank holding the
loss) is read from it: ``Topology`` builds its groups from it, the memory estimator and the planner
take it. A :class:`LayoutError` names the values.

Heterogeneous pipelines: ``stage_tp`` gives each pipeline rank its own tensor-parallel width (and
``stage_sp`` its own sequence parallelism), read from the per-stage form of ``parallel.pipeline_layout``
(:func:`stage_widths`). dp and cp stay uniform, so stage ``s`` has ``stage_tp[s]·cp·dp`` ranks, laid out
one stage after the other (pp slowest); :meth:`ParallelLayout.for_stage` is the homogeneous layout one
stage's ranks see.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import Any, Mapping

from megand.core.batch_shares import is_uneven, shares_error
from megand.core.pipeline_parallel.registry import DEFAULT_SCHEDULE, schedule_record

DIMS = ("tp", "cp", "dp", "pp")
DEFAULT_ORDER = "tp-cp-dp-pp"


class LayoutError(ValueError):
    """An impossible parallel layout; the message names the values."""


def check_sizes(**sizes) -> None:
    """Each of ``sizes`` (name -> value) a positive integer."""
    for name, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise LayoutError(f"parallel.{name}={size} must be a positive integer")


def parse_order(order: str) -> tuple[str, ...]:
    dims = tuple(order.split("-"))
    if sorted(dims) != sorted(DIMS):
        raise LayoutError(f"parallel.order={order!r} must list each of {'-'.join(DIMS)} exactly once")
    return dims


@dataclass(frozen=True)
class ParallelLayout:
    """One parallel layout, checked when made (see the module docstring); ``etp=None`` and
    ``dp_shard=None`` are resolved by :attr:`expert_tp` and :attr:`shard_size`."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    vpp: int | None = None  # model chunks per pipeline rank; None: one
    order: str = DEFAULT_ORDER
    dp_shard: int | None = None  # ranks of dp x cp per shard group; None: all
    ep: int = 1  # expert parallel: ranks of dp x cp over which the routed experts are split
    etp: int | None = None  # expert tensor parallel: 1 or tp; None: tp
    pp_schedule: str = DEFAULT_SCHEDULE  # parallel.pp_schedule: its record places the virtual stages
    # micro-batches per data-parallel replica (megand/core/batch_shares.py); None: equal shares
    dp_microbatches: tuple[int, ...] | None = None
    # per pipeline rank: tensor-parallel width and sequence parallelism (the per-stage pipeline_layout);
    # stage_tp None: every stage has tp (homogeneous); stage_sp None: parallel.sequence_parallel everywhere
    stage_tp: tuple[int, ...] | None = None
    stage_sp: tuple[bool, ...] | None = None

    def __post_init__(self):
        if self.stage_tp is not None:
            self._check_stages()
        check_sizes(tp=self.tp, pp=self.pp, cp=self.cp, dp=self.dp)
        if self.dp_microbatches is not None:
            object.__setattr__(self, "dp_microbatches", tuple(self.dp_microbatches))
        error = shares_error(self.dp, self.dp_microbatches)
        if error:
            raise LayoutError(error)
        parse_order(self.order)
        dp_shard = self.dp_shard
        if dp_shard is not None and (not isinstance(dp_shard, int) or isinstance(dp_shard, bool) or dp_shard < 1
                                     or self.dp_cp % dp_shard):
            raise LayoutError(f"parallel.dp_shard={dp_shard} must be a positive divisor of dp*cp = {self.dp}*{self.cp}"
                              f" = {self.dp_cp}")
        if not isinstance(self.ep, int) or self.ep < 1 or self.dp_cp % self.ep:
            raise LayoutError(f"parallel.ep={self.ep} must be a positive divisor of dp*cp = {self.dp}*{self.cp} = "
                              f"{self.dp_cp}")
        if self.expert_tp not in (1, self.tp):
            raise LayoutError(f"parallel.etp={self.etp} must be 1 or parallel.tp={self.tp}")
        error = self.schedule.layout_error(self.pp, self.vpp)
        if error:
            raise LayoutError(error)

    def _check_stages(self):
        """The per-stage widths: one per pipeline rank, the rank order pp-slowest, no expert parallelism;
        uniform widths and sequence parallelism are the homogeneous layout (``stage_tp`` dropped)."""
        widths = tuple(self.stage_tp)
        sp = tuple(bool(x) for x in self.stage_sp) if self.stage_sp is not None else (False,) * len(widths)
        if len(widths) != self.pp or len(sp) != self.pp:
            raise LayoutError(f"per-stage tp {list(widths)} (sequence parallel {list(sp)}) must have parallel.pp={self.pp} entries")
        check_sizes(**{f"pipeline_layout tp of stage {s}": w for s, w in enumerate(widths)})
        sp = tuple(x and w > 1 for x, w in zip(sp, widths))  # sequence parallelism over one rank is none
        object.__setattr__(self, "stage_sp", sp)
        if len(set(zip(widths, sp))) == 1:  # one width: the plain grid
            object.__setattr__(self, "tp", widths[0])
            object.__setattr__(self, "stage_tp", None)
            return
        object.__setattr__(self, "stage_tp", widths)
        object.__setattr__(self, "tp", max(widths))
        if parse_order(self.order)[-1] != "pp":
            raise LayoutError(f"parallel.order={self.order!r} with per-stage tp {list(widths)}: stages of different "
                              f"widths need pp slowest (e.g. {DEFAULT_ORDER})")
        if self.ep != 1 or self.etp not in (None, 1) and len(set(widths)) > 1:
            raise LayoutError(f"parallel.ep={self.ep}, parallel.etp={self.etp} with per-stage tp {list(widths)}: "
                              f"expert parallelism over stages of different widths is not supported (ep=1)")

    @property
    def heterogeneous(self) -> bool:
        """Pipeline stages of different tensor-parallel widths (or sequence parallelism)."""
        return self.stage_tp is not None

    def stage_tp_of(self, stage: int) -> int:
        return self.stage_tp[stage] if self.stage_tp is not None else self.tp

    def stage_sp_of(self, stage: int, default: bool = False) -> bool:
        """Whether pipeline rank ``stage`` runs sequence parallelism (``default``: parallel.sequence_parallel,
        where the layout does not say)."""
        return self.stage_sp[stage] if self.stage_sp is not None else bool(default)

    def for_stage(self, stage: int) -> "ParallelLayout":
        """The homogeneous layout that the ranks of pipeline rank ``stage`` see (its own tp)."""
        if self.stage_tp is None:
            return self
        return replace(self, tp=self.stage_tp[stage], stage_tp=None, stage_sp=None)

    def stage_offset(self, stage: int) -> int:
        """The first rank of pipeline rank ``stage`` (stages are consecutive runs of ranks, pp slowest)."""
        return sum(self.stage_tp_of(s) for s in range(stage)) * self.cp * self.dp

    def stage_of(self, rank: int) -> int:
        """The pipeline rank (stage) of global rank ``rank``."""
        if self.stage_tp is None:
            return self.coords(rank)["pp"]
        stage = 0
        while rank >= self.stage_offset(stage + 1):
            stage += 1
        return stage

    @classmethod
    def infer(cls, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, dp: int | None = None,
              **options) -> "ParallelLayout":
        """The layout of ``world_size`` ranks; ``dp=None`` takes what is left after tp·pp·cp (the sum of
        the stages' widths times cp with per-stage widths)."""
        check_sizes(tp=tp, pp=pp, cp=cp, dp=dp if dp is not None else 1)
        stage_tp = options.get("stage_tp")
        named = f"(stage widths {'+'.join(map(str, stage_tp))})*cp" if stage_tp else "tp*pp*cp"
        model_ranks = sum(stage_tp) * cp if stage_tp else tp * pp * cp
        if world_size % model_ranks and stage_tp:
            raise LayoutError(f"world size {world_size} is not divisible by {named} = ({'+'.join(map(str, stage_tp))})"
                              f"*{cp} = {model_ranks}")
        if world_size % model_ranks:
            raise LayoutError(f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {model_ranks}")
        inferred_dp = world_size // model_ranks
        if dp is not None and dp != inferred_dp:
            raise LayoutError(f"parallel.dp={dp} but world size {world_size} / ({named} = {model_ranks}) = "
                              f"{inferred_dp}")
        return cls(tp=tp, pp=pp, cp=cp, dp=inferred_dp, **options)

    @classmethod
    def from_keys(cls, keys: Mapping[str, Any], world_size: int | None = None) -> "ParallelLayout":
        """The layout the ``parallel`` config keys ``keys`` describe (other keys ignored; a missing or null
        key takes its default) on ``world_size`` ranks (:meth:`infer`; None: ``parallel.dp`` must be set).
        A per-stage ``pipeline_layout`` gives the stages' widths (:func:`stage_widths`)."""
        given = {f.name: keys[f.name] for f in fields(cls) if keys.get(f.name) is not None}
        widths = stage_widths(keys)
        if widths is not None:
            given["stage_tp"], given["stage_sp"] = widths
        if world_size is not None:
            return cls.infer(world_size, **given)
        if "dp" not in given:
            raise LayoutError("parallel.dp is null: pass world_size")
        return cls(**given)

    @staticmethod
    def world_of(keys: Mapping[str, Any]) -> int:
        """The ranks the ``parallel`` config keys ``keys`` name: tp·pp·cp·dp (the sum of the stages' widths
        for tp·pp with per-stage widths), a null dp counted as 1 (the tools' default world size;
        unchecked: :meth:`from_keys` checks)."""
        widths = stage_widths(keys)
        tp_pp = sum(widths[0]) if widths is not None else \
            math.prod(1 if keys.get(name) is None else keys.get(name) for name in ("tp", "pp"))
        return tp_pp * math.prod(1 if keys.get(name) is None else keys.get(name) for name in ("cp", "dp"))

    @classmethod
    def or_error(cls, **values) -> "ParallelLayout | LayoutError":
        """The layout of ``values``, or the :class:`LayoutError` it would raise (returned, not raised: for
        searches that try many sizes and keep those that hold)."""
        try:
            return cls(**values)
        except LayoutError as e:
            return e

    def with_(self, **changes) -> "ParallelLayout":
        return replace(self, **changes)

    @property
    def schedule(self):
        """The pipeline schedule's record (megand/core/pipeline_parallel/record.py); an unknown name is a
        :class:`LayoutError`."""
        try:
            return schedule_record(self.pp_schedule)
        except ValueError as e:
            raise LayoutError(str(e)) from None

    def coords(self, rank: int) -> dict[str, int]:
        """The grid coordinates of ``rank``: the first dimension of :attr:`order` varies fastest (with
        per-stage widths: the stage, then the coordinates in that stage's own grid)."""
        if self.stage_tp is not None:
            stage = self.stage_of(rank)
            return {**self.for_stage(stage).with_(pp=1, vpp=None, pp_schedule=DEFAULT_SCHEDULE).coords(
                rank - self.stage_offset(stage)), "pp": stage}
        coords = {}
        for dim in parse_order(self.order):
            size = getattr(self, dim)
            coords[dim] = rank % size
            rank //= size
        return coords

    @property
    def world_size(self) -> int:
        return self.model_ranks * self.dp

    @property
    def model_ranks(self) -> int:
        """Ranks of one model replica (tp·pp·cp; the sum of the stages' widths times cp with per-stage
        widths): the world size is dp times this."""
        if self.stage_tp is not None:
            return sum(self.stage_tp) * self.cp
        return self.tp * self.pp * self.cp

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage."""
        return self.tp * self.cp * self.dp

    @property
    def dp_cp(self) -> int:
        return self.dp * self.cp

    @property
    def shard_size(self) -> int:
        """Ranks of one shard group (sharded data parallelism): ``dp_shard``, or all of dp x cp."""
        return self.dp_shard or self.dp_cp

    @property
    def uneven_shares(self) -> bool:
        """Data-parallel replicas take different numbers of micro-batches per step."""
        return is_uneven(self.dp_microbatches)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def edp(self) -> int:
        """Ranks holding the same expert shard (expert data parallelism): tp·dp·cp / (ep·etp)."""
        return self.stage_size // (self.ep * self.expert_tp)

    def sequence_multiple(self, sequence_parallel: bool) -> int:
        """What the sequence length must be a multiple of: 2·cp load-balanced chunks under context
        parallelism, times tp under sequence parallelism (every stage's, with per-stage widths)."""
        cp = 2 * self.cp if self.cp > 1 else 1
        if self.stage_sp is not None:
            return cp * math.lcm(*(self.stage_tp_of(s) if self.stage_sp[s] else 1 for s in range(self.pp)))
        return cp * (self.tp if sequence_parallel else 1)

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank."""
        return self.placement.vpp if self.pp > 1 else 1

    @property
    def interleaved(self) -> bool:
        """More than one model chunk per pipeline rank."""
        return self.pp > 1 and (self.vpp or 1) > 1

    @property
    def steady_microbatches(self) -> int:
        """Micro-batches per dp rank that reach the schedule's steady state (peak activations in flight)."""
        if self.pp == 1:
            return 2  # the second repeats the first with the gradients already accumulating
        return 2 * self.pp if self.interleaved else self.pp

    def microbatches(self, global_batch_size: int, micro_batch_size: int) -> int:
        """Micro-batches per dp rank in a step of ``global_batch_size`` samples (rounded down)."""
        return global_batch_size // (micro_batch_size * self.dp)

    @cached_property
    def placement(self):
        """Where the virtual stages live (the schedule's placement over pp ranks)."""
        return self.schedule.placement(self.pp, self.vpp)

    @property
    def last_stage_rank(self) -> int:
        """The pipeline rank holding the last virtual stage (the loss): the last, or rank 0 of a V."""
        return self.placement.last_rank if self.pp > 1 else 0


STAGE_KEYS = ("layers", "tp", "sp")  # the keys of one entry of the per-stage parallel.pipeline_layout


def stage_widths(keys: Mapping[str, Any]) -> tuple[tuple[int, ...], tuple[bool, ...]] | None:
    """Per pipeline rank, ``(tp widths, sequence parallelism)`` from the ``parallel`` keys' per-stage
    ``pipeline_layout`` (entries ``{layers: n, tp: w, sp: bool}``, one per virtual stage; a missing tp or
    sp is ``parallel.tp`` / ``parallel.sequence_parallel``); None for the list-of-ints form or none.
    The virtual stages one pipeline rank holds (vpp, a V) share its width: entries that disagree are
    refused."""
    entries = keys.get("pipeline_layout")
    if entries is None or not any(isinstance(e, Mapping) for e in entries):
        return None
    entries = list(entries)
    if not all(isinstance(e, Mapping) for e in entries):
        raise LayoutError(f"parallel.pipeline_layout={entries}: either layers per stage (integers) or one "
                          f"{{layers, tp, sp}} entry per stage, not both")
    for e in entries:
        unknown = sorted(set(e) - set(STAGE_KEYS))
        if unknown or "layers" not in e:
            raise LayoutError(f"parallel.pipeline_layout entry {dict(e)}: keys are {', '.join(STAGE_KEYS)} "
                              f"(layers required)")
    pp, vpp = keys.get("pp") or 1, keys.get("vpp")
    if len(entries) != pp * (vpp or 1):
        raise LayoutError(f"parallel.pipeline_layout has {len(entries)} entries; parallel.pp*vpp = "
                          f"{pp}*{vpp or 1} = {pp * (vpp or 1)}")
    default_tp, default_sp = keys.get("tp") or 1, bool(keys.get("sequence_parallel"))
    per_virtual = [(e.get("tp", default_tp), bool(e.get("sp", default_sp))) for e in entries]
    try:
        placement = schedule_record(keys.get("pp_schedule") or DEFAULT_SCHEDULE).placement(pp, vpp) if pp > 1 else None
    except ValueError as e:
        raise LayoutError(str(e)) from None
    widths = []
    for rank in range(pp):
        held = sorted({per_virtual[placement.stage(rank, c) if placement else 0] for c in range(vpp or 1)})
        if len(held) > 1:
            raise LayoutError(f"parallel.pipeline_layout: the virtual stages of pipeline rank {rank} ask for "
                              f"different (tp, sp) {held}; a rank has one width")
        widths.append(held[0])
    return tuple(w for w, _ in widths), tuple(sp for _, sp in widths)
