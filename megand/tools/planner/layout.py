"""A candidate layout (the keys the planner chooses) and where its ranks run (cluster groups, nodes,
and which link each process group spans, from megand's own rank grid)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Optional

from megand.core.parallel_layout import ParallelLayout
from megand.core.parallel_state import DEFAULT_ORDER, ParallelSizes, rank_coords, rank_groups
from megand.tools.estimate_memory import parallel_layout
from megand.core.pipeline_parallel.registry import DEFAULT_SCHEDULE


@dataclass(frozen=True)
class Candidate:
    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    cp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    sharding: str = "none"
    dp_shard: Optional[int] = None
    micro_batch_size: int = 1
    recompute: str = "none"
    recompute_layers: Optional[tuple] = None  # per virtual stage: how many of its first layers recompute; None: all
    pp_schedule: str = DEFAULT_SCHEDULE  # the pipeline schedule (1f1b: interleaved with vpp)
    cp_comm: str = "p2p"
    precision: str = "bf16"
    pipeline_layout: Optional[tuple] = None  # layers per virtual stage; None: even
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    reshard_after_forward: bool = True
    bucket_size: int = 40_000_000
    order: str = DEFAULT_ORDER
    # not a config key: whether attention runs as one fused (flash) kernel that never stores the s x s
    # probabilities. None: megand's SDPA in 16-bit on GPUs (fused); fp32 (CPU runs) counted unfused
    fused_attention: Optional[bool] = None
    optimizer: str = "adamw"  # optim.name (not searched): Muon adds Newton-Schulz to the step, saves one moment
    fp8: Optional[str] = None  # train.fp8 (not searched): those layers' GEMMs at the FP8 peak
    fp8_bf16_layers: int = 1  # train.fp8_bf16_layers: first and last layers kept in bf16

    @property
    def fused(self) -> bool:
        return self.precision != "fp32" if self.fused_attention is None else self.fused_attention

    @property
    def parallel(self) -> ParallelLayout:
        """The candidate's parallel sizes as megand's one layout value (a LayoutError if they break its rules)."""
        return parallel_layout(tp=self.tp, pp=self.pp, cp=self.cp, dp=self.dp, vpp=self.vpp, order=self.order,
                               dp_shard=self.dp_shard, pp_schedule=self.pp_schedule)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage."""
        return self.tp * self.cp * self.dp

    def with_(self, **changes) -> "Candidate":
        return replace(self, **changes)

    def settings(self) -> dict:
        """The config keys this candidate sets (dotted key -> value)."""
        return {
            "parallel.tp": self.tp, "parallel.pp": self.pp, "parallel.vpp": self.vpp, "parallel.cp": self.cp,
            "parallel.dp": self.dp, "parallel.sequence_parallel": self.sequence_parallel,
            "parallel.dp_shard": self.dp_shard, "parallel.cp_comm": self.cp_comm,
            "parallel.pipeline_layout": list(self.pipeline_layout) if self.pipeline_layout else None,
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


def override_value(value) -> str:
    """A value as Hydra's command line reads it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(str(v) for v in value) + "]"
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
    sizes = ParallelSizes(tp=tp, cp=cp, dp=dp, pp=pp)
    groups = rank_groups(sizes, order, dp_shard)
    stage_of = [rank_coords(r, sizes, order)["pp"] for r in range(sizes.world_size)]
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
        size = candidate.stage_size
        for g in stage_groups:
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
