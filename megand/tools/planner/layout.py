"""A candidate layout (the keys the planner chooses: megand's parallel layout value and the run's other
choices) and where its ranks run (cluster groups, nodes, and which link each process group spans, from
megand's own rank grid)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import Optional

from megand.core.parallel_layout import LayoutError, ParallelLayout
from megand.core.parallel_state import rank_groups
from megand.tools.estimate_memory import PARALLEL_KEYS, parallel_layout


# the parallel keys the planner weighs (its cost model has no expert parallelism: candidates keep ep=1)
PLANNED_KEYS = ("tp", "pp", "vpp", "cp", "dp", "dp_shard", "order", "pp_schedule")


def planned_layout(parallel, world_size: int, keys=PLANNED_KEYS) -> ParallelLayout:
    """The layout of the ``parallel`` config keys ``keys`` on ``world_size`` ranks, as a candidate holds it."""
    return ParallelLayout.from_keys({k: parallel.get(k) for k in keys}, world_size)


@lru_cache(maxsize=4096)
def layout_or_error(**sizes) -> ParallelLayout | LayoutError:
    """:meth:`ParallelLayout.or_error`, once per distinct layout: the search tries the same few sizes for many
    candidates, most of which break no rule."""
    return ParallelLayout.or_error(**sizes)


@dataclass(frozen=True)
class Candidate:
    """One layout the planner weighs: megand's parallel layout value (checked when made: the search keeps
    only the sizes that hold, :func:`layout_or_error`) and the other keys it chooses. :meth:`of` takes
    them as flat keys."""

    parallel: ParallelLayout = ParallelLayout()
    sequence_parallel: bool = False
    sharding: str = "none"
    micro_batch_size: int = 1
    recompute: str = "none"
    recompute_layers: Optional[tuple] = None  # per virtual stage: how many of its first layers recompute; None: all
    cp_comm: str = "p2p"
    precision: str = "bf16"
    pipeline_layout: Optional[tuple] = None  # layers per virtual stage; None: even
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    reshard_after_forward: bool = True
    bucket_size: int = 40_000_000
    # not a config key: whether attention runs as one fused (flash) kernel that never stores the s x s
    # probabilities. None: megand's SDPA in 16-bit on GPUs (fused); fp32 (CPU runs) counted unfused
    fused_attention: Optional[bool] = None
    optimizer: str = "adamw"  # optim.name (not searched): its record gives the states kept, the bytes and matrix work of its step
    fp8: Optional[str] = None  # train.fp8 (not searched): those layers' GEMMs at the FP8 peak
    fp8_bf16_layers: int = 1  # train.fp8_bf16_layers: first and last layers kept in bf16
    # per pipeline rank: (tp, sequence_parallel) where stages differ in width (a heterogeneous pipeline whose
    # groups each run their own tp); None: every stage runs ``tp`` (cp and dp stay uniform either way)
    stage_widths: Optional[tuple] = None

    @classmethod
    def of(cls, **keys) -> "Candidate":
        """A candidate from flat keys: the parallel ones (``estimate_memory.PARALLEL_KEYS``: a LayoutError
        names values that break a rule) and this class's fields."""
        sizes = {k: keys.pop(k) for k in PARALLEL_KEYS if k in keys}
        return cls(parallel=parallel_layout(**sizes), **keys)

    @classmethod
    def or_none(cls, **keys) -> "Candidate | None":
        """:meth:`of`, or None where the parallel sizes break a rule of the layout (not raised: the search
        tries every combination and keeps those that hold)."""
        sizes = {k: keys.pop(k) for k in PARALLEL_KEYS if k in keys}
        layout = layout_or_error(**sizes)
        return None if isinstance(layout, LayoutError) else cls(parallel=layout, **keys)

    @property
    def fused(self) -> bool:
        return self.precision != "fp32" if self.fused_attention is None else self.fused_attention

    # the parallel layout's sizes and options
    tp = property(lambda self: self.parallel.tp)
    pp = property(lambda self: self.parallel.pp)
    vpp = property(lambda self: self.parallel.vpp)
    cp = property(lambda self: self.parallel.cp)
    dp = property(lambda self: self.parallel.dp)
    dp_shard = property(lambda self: self.parallel.dp_shard)
    order = property(lambda self: self.parallel.order)
    pp_schedule = property(lambda self: self.parallel.pp_schedule)
    stage_size = property(lambda self: self.parallel.stage_size)  # the first stage's ranks

    @property
    def stage_sizes(self) -> list:
        """Ranks per pipeline stage (differ where :attr:`stage_widths` does)."""
        if self.stage_widths is None:
            return [self.stage_size] * self.pp
        return [tp * self.cp * self.dp for tp, _ in self.stage_widths]

    @property
    def world_size(self) -> int:
        return sum(self.stage_sizes) if self.stage_widths is not None else self.parallel.world_size

    def of_rank(self, r: int) -> "Candidate":
        """The uniform layout whose stage ``r`` is this candidate's (each stage's own time, memory and
        groups are those of every stage at its width)."""
        if self.stage_widths is None:
            return self
        return _of_rank(self, r)

    def widths(self) -> list:
        """The distinct per-stage candidates (:meth:`of_rank`), one per width, first stage's first."""
        if self.stage_widths is None:
            return [self]
        return [self.of_rank(self.stage_widths.index(w)) for w in dict.fromkeys(self.stage_widths)]

    def with_(self, **changes) -> "Candidate":
        """This candidate with ``changes`` (flat keys, as :meth:`of` takes them)."""
        sizes = {k: changes.pop(k) for k in PARALLEL_KEYS if k in changes}
        if sizes:
            try:
                changes["parallel"] = _layout_with(self.parallel, tuple(sorted(sizes.items())))
            except TypeError:  # a value that is not hashable (a list of shares): uncached
                changes["parallel"] = self.parallel.with_(**sizes)
        if not changes.keys() <= _FIELDS:
            return replace(self, **changes)  # names the unknown key
        # dataclasses.replace re-runs __init__ over every field: the search makes millions of these copies,
        # and a candidate has no __post_init__ to skip
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        return new

    def layout_setting(self):
        """``parallel.pipeline_layout``: layers per virtual stage, or with :attr:`stage_widths` one entry per
        virtual stage ``{layers, tp, sp}`` (its rank's width)."""
        if self.stage_widths is None:
            return list(self.pipeline_layout) if self.pipeline_layout else None
        if self.pipeline_layout is None:  # the search always balances a mixed pipeline's layers
            raise ValueError("a pipeline of stages of different widths needs its layers per stage")
        layers = list(self.pipeline_layout)
        where = self.parallel.placement.location
        return [{"layers": n, "tp": self.stage_widths[where(s)[0]][0], "sp": self.stage_widths[where(s)[0]][1]}
                for s, n in enumerate(layers)]

    def settings(self) -> dict:
        """The config keys this candidate sets (dotted key -> value)."""
        return {
            "parallel.tp": self.tp, "parallel.pp": self.pp, "parallel.vpp": self.vpp, "parallel.cp": self.cp,
            "parallel.dp": self.dp, "parallel.sequence_parallel": self.sequence_parallel,
            "parallel.dp_microbatches": list(self.parallel.dp_microbatches) if self.parallel.dp_microbatches else None,
            "parallel.dp_shard": self.dp_shard, "parallel.cp_comm": self.cp_comm,
            "parallel.pipeline_layout": self.layout_setting(),
            "parallel.order": self.order,
            "optim.sharding": self.sharding, "optim.overlap_grad_reduce": self.overlap_grad_reduce,
            "optim.overlap_param_gather": self.overlap_param_gather,
            "optim.reshard_after_forward": self.reshard_after_forward, "optim.bucket_size": self.bucket_size,
            "train.micro_batch_size": self.micro_batch_size, "train.recompute": self.recompute,
            "train.recompute_layers": list(self.recompute_layers) if self.recompute_layers is not None else None,
            "train.precision": self.precision,
            # always written: a schedule left out would keep a preset's (or the previous trial's) choice
            "parallel.pp_schedule": self.pp_schedule,
        }


@lru_cache(maxsize=65536)
def _layout_with(parallel: ParallelLayout, sizes: tuple) -> ParallelLayout:
    """``parallel.with_(**sizes)`` once per layout and change (each copy re-checks every rule of the layout)."""
    return parallel.with_(**dict(sizes))


_FIELDS = frozenset(f.name for f in fields(Candidate))


@lru_cache(maxsize=65536)
def _of_rank(c: Candidate, r: int) -> Candidate:
    """:meth:`Candidate.of_rank`, once per candidate and rank (the search asks for each stage's memory and
    times many times over)."""
    tp, sp = c.stage_widths[r]
    return c.with_(tp=tp, sequence_parallel=sp, stage_widths=None)


def override_value(value) -> str:
    """A value as Hydra's command line reads it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override_value(v)}" for k, v in value.items()) + "}"
    return str(value)


@lru_cache(maxsize=256)
def _groups(tp: int, cp: int, dp: int, pp: int, order: str, dp_shard):
    """megand's process groups of this grid, and the pipeline stage of every rank.

    With pp slowest-varying (the default order), stage r's ranks are ``r*S .. r*S + S - 1`` (S = tp·cp·dp)
    and its groups those of the one-stage grid shifted by r·S: only that grid is built, so the planner
    stays fast on tens of thousands of ranks. Other orders build the whole grid.
    """
    if order.endswith("-pp") and pp > 1:
        one, _ = _groups(tp, cp, dp, 1, order, dp_shard)
        size = tp * cp * dp
        groups = {kind: [[rank + r * size for rank in ranks] for r in range(pp) for ranks in lists]
                  for kind, lists in one.items() if kind not in ("pp", "embedding", "mp")}
        groups["pp"] = [[j + r * size for r in range(pp)] for j in range(size)]
        return groups, [rank // size for rank in range(size * pp)]
    layout = ParallelLayout(tp=tp, cp=cp, dp=dp, pp=pp, order=order, dp_shard=dp_shard)  # the groups' sizes alone
    groups = rank_groups(layout)
    stage_of = [layout.coords(r)["pp"] for r in range(layout.world_size)]
    return groups, stage_of


@dataclass(frozen=True)
class Placement:
    """Ranks on devices: ``stage_groups[r]`` is the cluster group of pipeline stage r; ``node_of[rank]``
    the (group name, node index) the rank runs on; ``nodes`` the launch order of the nodes."""

    stage_groups: tuple
    node_of: tuple
    nodes: tuple


def place(candidate: Candidate, stage_groups) -> Placement:
    """Ranks in launch order (rank ``i`` is the ``i``-th process started, ``devices_per_node`` per node).

    With one group, rank ``i`` is on node ``i // devices_per_node``. With several (heterogeneous), the
    order must make the pipeline dimension slowest (the default order), so each stage's ranks are
    consecutive and are laid on its group's next free devices.
    """
    world = candidate.world_size
    if len({g.name for g in stage_groups}) == 1:
        g = stage_groups[0]
        node_of = tuple((g.name, rank // g.devices_per_node) for rank in range(world))
    else:
        if not candidate.order.endswith("pp"):
            raise ValueError(f"parallel.order={candidate.order}: a heterogeneous plan needs pp slowest-varying")
        used, node_list = {}, []
        for g, size in zip(stage_groups, candidate.stage_sizes):
            start = used.get(g.name, 0)
            node_list += [(g.name, (start + j) // g.devices_per_node) for j in range(size)]
            used[g.name] = start + size
        node_of = tuple(node_list)
    nodes = tuple(dict.fromkeys(node_of))
    return Placement(stage_groups=tuple(stage_groups), node_of=node_of, nodes=nodes)


def spanned_links(candidate: Candidate, placement: Placement) -> dict:
    """``{kind: [link per pipeline stage]}`` for the tp, cp, dp_cp, dp_shard and dp_replica groups (intra_node
    when every group of that kind on that stage stays on one node) and ``{"pp": [link per boundary]}``
    (between stage r and r + 1), from megand's rank grid (megand/core/parallel_state.py)."""
    c = candidate
    groups, stage_of = _groups(c.tp, c.cp, c.dp, c.pp, c.order, c.dp_shard)
    node_of = placement.node_of
    links = {}
    for kind in ("tp", "cp", "dp_cp", "dp_shard", "dp_replica"):
        per_stage = ["intra_node"] * c.pp
        for ranks in groups[kind]:
            if len({node_of[r] for r in ranks}) > 1:
                per_stage[stage_of[ranks[0]]] = "inter_node"
        links[kind] = per_stage
    boundary = ["intra_node"] * max(c.pp - 1, 0)
    for ranks in groups["pp"]:
        for r in range(c.pp - 1):
            if node_of[ranks[r]] != node_of[ranks[r + 1]]:
                boundary[r] = "inter_node"
    links["pp"] = boundary
    return links
