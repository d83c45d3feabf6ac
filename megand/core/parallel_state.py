"""Topology: the rank grid and every process group of a run.

The grid has four dimensions: tensor (tp), context (cp), data (dp) and pipeline (pp). An order string
such as ``"tp-cp-dp-pp"`` lists them from fastest- to slowest-varying rank index, so with the default
order tensor-parallel peers are neighbouring ranks (same node) and pipeline stages are farthest apart.

Experts (the routed experts of MoE layers) live on a second grid over the same ranks, as in
Megatron-core: expert tensor parallel (etp: 1 or tp), expert parallel (ep), expert data parallel
(edp = tp*cp*dp / (etp*ep)) and pp, in the dense order with ``tp`` read as ``etp-ep`` (ep ranks adjacent
after etp) and cp folded into edp. Expert weights are split over ep (whole experts) and etp, and their
gradients are summed over the expert-dp group: the ranks holding the same experts.

:func:`rank_groups` is a pure function of the layout (:class:`~megand.core.parallel_layout.ParallelLayout`,
the one value holding the sizes) returning plain rank lists, so the layout is unit-tested without
processes. :class:`Topology` creates the live groups of a layout (collectively: every rank creates every
group, in the same order) and is the one object passed to whatever needs a group. There is no module-level state.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from functools import cached_property
from datetime import timedelta

import torch
import torch.distributed as dist

from megand.core.batch_shares import replica_rows
from megand.core.parallel_layout import DEFAULT_ORDER, DIMS, LayoutError, ParallelLayout, parse_order
from megand.core.pipeline_parallel.registry import DEFAULT_SCHEDULE

# Every group a run needs, as the grid dimensions it spans.
GROUP_DIMS = {
    "tp": ("tp",),
    "cp": ("cp",),
    "dp": ("dp",),
    "pp": ("pp",),
    "dp_cp": ("dp", "cp"),  # gradient reduction and the distributed optimizer's shards
    "mp": ("tp", "pp"),  # model parallel: one full replica of the model
}


# The expert grid's groups, as the expert-grid dimensions they span.
EXPERT_GROUP_DIMS = {
    "ep": ("ep",),  # token all-to-all: the ranks holding the other experts
    "etp": ("etp",),  # one expert's tensor-parallel shards
    "expert_dp": ("edp",),  # the ranks holding the same expert shards: expert gradients are summed here
    "expert_tp_ep": ("etp", "ep"),  # every shard of every expert: the dispatch's count exchange
}


def _grid_groups(world: int, dims: tuple[str, ...], size_of: dict[str, int], kinds: dict) -> dict[str, list[list[int]]]:
    """For each kind of ``kinds`` (name -> spanned dims), the sorted rank lists of a grid whose first
    dimension varies fastest."""
    coords = []
    for r in range(world):
        c, rest = {}, r
        for d in dims:
            c[d], rest = rest % size_of[d], rest // size_of[d]
        coords.append(c)
    groups = {}
    for kind, spanned in kinds.items():
        by_key: dict[tuple, list[int]] = {}
        for r in range(world):
            by_key.setdefault(tuple(coords[r][d] for d in dims if d not in spanned), []).append(r)
        groups[kind] = sorted(by_key.values())
    return groups


def expert_rank_groups(layout: ParallelLayout) -> dict[str, list[list[int]]]:
    """The expert grid's groups (``EXPERT_GROUP_DIMS``) of ``layout`` as rank lists; pure, like
    :func:`rank_groups`.

    ep=1: the experts follow the dense grid (etp=tp: etp = tp groups, expert dp = dp x cp; etp=1: expert
    dp = tp x dp x cp), whatever the order. ep>1: Megatron-core's expert grid (see the module docstring);
    its pipeline groups (and with etp=tp its etp groups) must be the dense ones, else the order is
    rejected.
    """
    etp, ep, order, world = layout.expert_tp, layout.ep, layout.order, layout.world_size
    dims = parse_order(order)
    if ep == 1:
        spanned = {"ep": (), "etp": ("tp",) if etp == layout.tp else (), "expert_dp": ("cp", "dp") + (() if etp == layout.tp else ("tp",))}
        spanned["expert_tp_ep"] = spanned["etp"]
        return _grid_groups(world, dims, {d: getattr(layout, d) for d in DIMS}, spanned)
    expert_dims = tuple(x for d in dims for x in {"tp": ("etp", "ep"), "cp": (), "dp": ("edp",), "pp": ("pp",)}[d])
    size_of = {"etp": etp, "ep": ep, "edp": layout.edp, "pp": layout.pp}
    groups = _grid_groups(world, expert_dims, size_of, {**EXPERT_GROUP_DIMS, "pp": ("pp",)})
    dense = _grid_groups(world, dims, {d: getattr(layout, d) for d in DIMS}, {"pp": ("pp",), "tp": ("tp",)})
    if groups.pop("pp") != dense["pp"] or (etp == layout.tp and groups["etp"] != dense["tp"]):
        raise LayoutError(f"parallel.order={order!r} with ep={ep}, etp={etp}: the expert grid "
                          f"({'-'.join(expert_dims)}) does not keep the pipeline and tensor-parallel groups; "
                          f"use an order with tp first and pp last (e.g. {DEFAULT_ORDER})")
    return groups


def rank_groups(layout: ParallelLayout) -> dict[str, list[list[int]]]:
    """For each group kind of ``layout``, the list of rank lists (each sorted ascending; pp lists are in
    stage order).

    Pure: no processes involved. A group of kind ``k`` holds the ranks that differ only in the
    dimensions ``GROUP_DIMS[k]``. The embedding group joins the first and last stage of each pipeline.
    Sharded data parallelism adds ``dp_shard`` (each dp x cp group cut into runs of ``layout.shard_size``
    adjacent ranks: the shard groups) and ``dp_replica`` (the ranks at the same place of every shard
    group of one dp x cp group: the replicas of one shard).
    """
    if layout.heterogeneous:
        return stage_rank_groups(layout)
    dims = parse_order(layout.order)
    world = layout.world_size
    coords = [layout.coords(r) for r in range(world)]
    groups = {}
    for kind, spanned in GROUP_DIMS.items():
        fixed = [d for d in dims if d not in spanned]
        by_key: dict[tuple, list[int]] = {}
        for r in range(world):
            by_key.setdefault(tuple(coords[r][d] for d in fixed), []).append(r)
        groups[kind] = sorted(by_key.values())
    groups["embedding"] = [sorted({p[0], p[-1]}) for p in groups["pp"]]
    groups["dp_shard"], groups["dp_replica"] = shard_groups(groups["dp_cp"], layout.shard_size)
    groups.update(expert_rank_groups(layout))
    return groups


def stage_rank_groups(layout: ParallelLayout) -> dict[str, list[list[int]]]:
    """:func:`rank_groups` of a layout whose pipeline stages have different tp widths (pure).

    Each stage is its own grid of ``stage_tp[s]·cp·dp`` ranks (a run of consecutive ranks, pp slowest):
    its groups of every kind that stays inside a stage (tp, cp, dp, dp x cp, shard, expert groups) are
    those of that grid. The kinds that cross stages join the ranks of one (dp, cp) coordinate over every
    stage: ``pp`` (the pipeline's point-to-point communicators: a rank talks to several ranks of a stage
    of another width, megand/core/pipeline_parallel/hand_off.py) and ``mp`` (one full model replica,
    for the grad norm). The embedding group pairs the first and the last stage by tp rank where their
    widths agree (tied embeddings over stages of different widths are refused by the config check)."""
    groups: dict[str, list[list[int]]] = {}
    for stage in range(layout.pp):
        grid = layout.for_stage(stage).with_(pp=1, vpp=None, pp_schedule=DEFAULT_SCHEDULE)
        offset = layout.stage_offset(stage)
        for kind, rank_lists in rank_groups(grid).items():
            if kind not in ("pp", "mp", "embedding"):
                groups.setdefault(kind, []).extend([offset + r for r in ranks] for ranks in rank_lists)
    replica: dict[tuple, list[int]] = {}
    coords = [layout.coords(r) for r in range(layout.world_size)]
    for r, c in enumerate(coords):
        replica.setdefault((c["dp"], c["cp"]), []).append(r)
    groups["pp"] = groups["mp"] = sorted(replica.values())
    first, last = layout.stage_tp[0], layout.stage_tp[-1]
    if first == last:
        where = {(c["pp"], c["tp"], c["cp"], c["dp"]): r for r, c in enumerate(coords)}
        groups["embedding"] = sorted([where[(0, c["tp"], c["cp"], c["dp"])], r] for r, c in enumerate(coords)
                                     if c["pp"] == layout.pp - 1)
    return {kind: sorted(lists) for kind, lists in groups.items()}


def tp_run_groups(tp_groups: list[list[int]]) -> dict[str, list[list[int]]]:
    """For each proper divisor ``n > 1`` of tp, kind ``tp_run<n>``: each tp group cut into runs of ``n``
    consecutive tp ranks (the ranks whose query heads share one key/value head; see ``ParamMeta.tp_replicas``).
    Pure; none for tp <= 3. With stages of different widths, each tp group of a width ``n`` divides."""
    runs: dict[str, list[list[int]]] = {}
    for g in tp_groups:
        for n in range(2, len(g)):
            if len(g) % n == 0:
                runs.setdefault(f"tp_run{n}", []).extend(g[i: i + n] for i in range(0, len(g), n))
    return runs


def shard_groups(dp_cp_groups: list[list[int]], shard: int):
    """``(shard groups, replica groups)`` cut from the dp x cp groups into runs of ``shard`` ranks (a
    divisor of their size: :attr:`~megand.core.parallel_layout.ParallelLayout.shard_size`; see
    :func:`rank_groups`)."""
    size = len(dp_cp_groups[0])
    shards = [g[i: i + shard] for g in dp_cp_groups for i in range(0, size, shard)]
    replicas = [g[j::shard] for g in dp_cp_groups for j in range(shard)]
    return sorted(shards), sorted(replicas)


def local_rank() -> int:
    """This process's index on its node, as the launcher (torchrun, SLURM via torchrun) set it."""
    return int(os.environ.get("LOCAL_RANK", 0))


def choose_device_and_backend() -> tuple[torch.device, str]:
    """The one place where the device and the collective backend are chosen."""
    if torch.cuda.is_available():
        # per node: the local rank (never the global rank); modulo the visible devices for launchers
        # (e.g. SLURM with one GPU bound per task) that leave each process a single visible device
        return torch.device("cuda", local_rank() % torch.cuda.device_count()), "nccl"
    return torch.device("cpu"), "gloo"


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability ``(major, minor)`` of ``device`` (which kernels it has: FP8 from 8.9,
    MX block scaling from 10.0), None for a device that is not CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))


def init_distributed(timeout_s: float | None = None) -> torch.device:
    """Join (or create) the default process group; a plain ``python`` launch is a world of one.

    ``timeout_s``: how long a collective may wait before the backend aborts it (NCCL's watchdog, gloo's
    timeout); None keeps torch's default (10 minutes for NCCL, 30 for gloo). Groups made by
    :class:`Topology` take the same value."""
    device, backend = choose_device_and_backend()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        if timeout_s is not None and timeout_s > 0:  # a bad value is reported by the config check
            kwargs["timeout"] = timedelta(seconds=timeout_s)
        if "RANK" not in os.environ:  # not launched by torchrun: a one-process world, no rendezvous needed
            kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
        elif reuses_agent_store():
            kwargs.update(restart_store())
        dist.init_process_group(backend, **kwargs)
    return device


def init_fake_distributed(rank: int, world_size: int) -> torch.device:
    """A default process group of ``world_size`` ranks in which this process plays ``rank`` alone: torch's
    ``fake`` backend, whose collectives return at once without communicating (values are not exchanged).
    For rehearsing one rank of a large layout in one process (tools, benchmarks, tests); the device is
    the CPU. torch ships this backend only in its testing package (a private module)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("init_fake_distributed: a default process group already exists")
    if not 0 <= rank < world_size:
        raise LayoutError(f"rank {rank} is not in a world of {world_size} ranks")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    return torch.device("cpu")


def reuses_agent_store() -> bool:
    """Workers restarted by torchrun (``--max-restarts``) that rendezvous through the agent's store, which
    outlives them (``TORCHELASTIC_USE_AGENT_STORE``): the previous attempt's keys are still in it. Without
    the agent's store (an elastic launch with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: megand's launcher
    sets it for a range of nodes) rank 0 of each rendezvous round hosts a new store on a new port, and the
    plain env:// init is right: the restart counts of agents that joined at different times differ, so no
    key derived from them would be shared by every worker of the round."""
    return (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def restart_store() -> dict:
    """The rendezvous of workers restarted by torchrun (``--max-restarts``) through the agent's store: it
    outlives its workers, so the previous attempt's keys (the addresses of dead ranks) are still there and a
    plain env:// init would read them and hang or fail to connect. Each attempt uses keys of its own."""
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
    return dict(store=dist.PrefixStore(f"megand/attempt_{attempt}", store), rank=rank, world_size=world)


def splits_communicators() -> bool:
    """Whether the default group makes subgroups by splitting its communicator (NCCL bound to a device,
    as :func:`init_distributed` binds it): each ``new_group`` is then a split over the whole world, which
    every rank, member or not, takes part in."""
    default = dist.distributed_c10d._get_default_group()
    device = getattr(default, "bound_device_id", None)
    if device is None:
        return False
    try:
        return bool(default._get_backend(device).supports_splitting)
    except RuntimeError:  # no backend for that device
        return False


def create_groups(lists: dict[str, list[list[int]]], rank: int, timeout: timedelta | None = None):
    """This rank's live group of each kind of ``lists`` (:func:`rank_groups`); collective: every rank
    calls it with the same lists.

    Identical groups are made once (``dp_shard`` = ``dp_cp`` without HSDP, expert groups that equal dense
    ones, every kind whose groups are single ranks). Where subgroups are communicator splits, each
    distinct kind is one split making all its groups at once (``split_group``): at 1024 ranks about ten
    world-wide splits instead of one per group (over a thousand). Elsewhere (gloo, the fake backend, lazily
    initialised NCCL) ``new_group`` costs ranks outside the group nothing but a counter, and is used."""
    groups: dict[str, dist.ProcessGroup] = {}
    if splits_communicators():
        made_kinds: dict[tuple, dist.ProcessGroup | None] = {}  # each distinct partition: this rank's group
        for kind, rank_lists in lists.items():
            key = tuple(map(tuple, rank_lists))
            if key not in made_kinds:
                made_kinds[key] = dist.split_group(split_ranks=rank_lists, timeout=timeout, group_desc=kind)
            if made_kinds[key] is not None:  # None: this rank is in no group of the kind (embedding, pp > 2)
                groups[kind] = made_kinds[key]
        return groups
    made: dict[tuple, dist.ProcessGroup] = {}
    for kind, rank_lists in lists.items():
        for ranks in rank_lists:  # every rank takes part in creating every group, in the same order
            if tuple(ranks) not in made:
                made[tuple(ranks)] = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                groups[kind] = made[tuple(ranks)]
    return groups


PIPELINE_CHANNELS = 4  # pipeline p2p: activations and gradients, each toward higher and lower stage ranks


def pipeline_channel_groups(pp_lists: list[list[int]], rank: int, pp_group, timeout: timedelta | None = None) -> tuple:
    """The pipeline's point-to-point communicators: :data:`PIPELINE_CHANNELS` groups over this rank's
    pipeline ranks (the pipeline group itself and three more, made as :func:`create_groups` makes every
    group: one world-wide split each where subgroups are communicator splits, else one ``new_group`` per
    pipeline); collective. Empty without pipelining.

    Why several: NCCL ignores tags and runs a communicator's point-to-point operations in the order they
    are queued, so one communicator would match messages of different kinds by order and hold a receive
    behind an unmatched send (megand/core/pipeline_parallel/p2p.py gives each kind of message and
    direction its own group, so each carries one stream of messages each way, in one order at both ends)."""
    if len(pp_lists[0]) == 1:
        return ()
    extra = [create_groups({"pp": pp_lists}, rank, timeout)["pp"] for _ in range(PIPELINE_CHANNELS - 1)]
    return (pp_group, *extra)


@dataclass
class Topology:
    """This rank's place in the grid and its live process groups.

    Built once, collectively, from the run's :class:`ParallelLayout` (the sizes live there; the topology
    reads them) after the default process group exists; passed explicitly to the model, schedules,
    optimizer and checkpointing. ``vpp`` is the number of model chunks per pipeline rank (interleaved
    schedule); ``None`` means no interleaving.
    """

    layout: ParallelLayout
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    timeout_s: float | None = None  # how long a collective of these groups may wait (None: torch's default)

    def __post_init__(self):
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = local_rank()
        if self.world_size != self.layout.world_size:
            raise LayoutError(f"world size {self.world_size} != tp*cp*dp*pp of {self.layout}")
        self.coords = self.layout.coords(self.rank)
        self.stage_layout = self.layout.for_stage(self.coords["pp"])  # this stage's own sizes (its tp)
        lists = rank_groups(self.layout)
        lists.update(tp_run_groups(lists["tp"]))
        self.ranks = {kind: mine for kind, rank_lists in lists.items()
                      for mine in rank_lists if self.rank in mine}
        if self.layout.heterogeneous:  # the pipeline as this rank sees it: its source in each stage
            self.ranks["pp"] = [self.hand_off.source(stage) for stage in range(self.pp_size)]
        timeout = None if self.timeout_s is None else timedelta(seconds=self.timeout_s)
        self.groups: dict[str, dist.ProcessGroup] = create_groups(lists, self.rank, timeout)
        self.pp_channel_groups = pipeline_channel_groups(lists["pp"], self.rank, self.groups["pp"], timeout)

    # the layout's options
    order = property(lambda self: self.layout.order)
    vpp = property(lambda self: self.layout.vpp)
    dp_shard = property(lambda self: self.layout.dp_shard)
    ep = property(lambda self: self.layout.ep)
    etp = property(lambda self: self.stage_layout.expert_tp)
    pp_schedule = property(lambda self: self.layout.pp_schedule)
    dp_microbatches = property(lambda self: self.layout.dp_microbatches)  # None: equal shares (batch_shares.py)

    # sizes and ranks within each dimension
    tp_size = property(lambda self: self.stage_layout.tp)  # this rank's stage's width
    cp_size = property(lambda self: self.layout.cp)
    dp_size = property(lambda self: self.layout.dp)
    pp_size = property(lambda self: self.layout.pp)
    tp_rank = property(lambda self: self.coords["tp"])
    cp_rank = property(lambda self: self.coords["cp"])
    dp_rank = property(lambda self: self.coords["dp"])
    pp_rank = property(lambda self: self.coords["pp"])
    dp_cp_size = property(lambda self: self.layout.dp_cp)
    dp_cp_rank = property(lambda self: self.ranks["dp_cp"].index(self.rank))
    dp_shard_size = property(lambda self: len(self.ranks["dp_shard"]))
    dp_shard_rank = property(lambda self: self.ranks["dp_shard"].index(self.rank))
    dp_replica_size = property(lambda self: len(self.ranks["dp_replica"]))
    dp_replica_rank = property(lambda self: self.ranks["dp_replica"].index(self.rank))
    ep_size = property(lambda self: self.ep)
    ep_rank = property(lambda self: self.ranks["ep"].index(self.rank))
    etp_size = property(lambda self: self.etp)
    etp_rank = property(lambda self: self.ranks["etp"].index(self.rank))
    expert_dp_size = property(lambda self: len(self.ranks["expert_dp"]))
    expert_dp_rank = property(lambda self: self.ranks["expert_dp"].index(self.rank))

    # live groups
    tp_group = property(lambda self: self.groups["tp"])
    cp_group = property(lambda self: self.groups["cp"])
    dp_group = property(lambda self: self.groups["dp"])
    pp_group = property(lambda self: self.groups["pp"])
    dp_cp_group = property(lambda self: self.groups["dp_cp"])
    mp_group = property(lambda self: self.groups["mp"])
    dp_shard_group = property(lambda self: self.groups["dp_shard"])
    dp_replica_group = property(lambda self: self.groups["dp_replica"])
    ep_group = property(lambda self: self.groups["ep"])
    etp_group = property(lambda self: self.groups["etp"])
    expert_dp_group = property(lambda self: self.groups["expert_dp"])
    expert_tp_ep_group = property(lambda self: self.groups["expert_tp_ep"])
    embedding_group = property(lambda self: self.groups.get("embedding"))

    # the ranks that compute one micro-batch together: every replica's micro-batch of an index (dp x cp),
    # or under uneven batch shares only the replica's own (cp): megand/core/batch_shares.py
    microbatch_group = property(lambda self: self.groups["cp" if self.layout.uneven_shares else "dp_cp"])
    microbatch_ranks = property(lambda self: self.cp_size if self.layout.uneven_shares else self.dp_cp_size)

    @cached_property
    def hand_off(self):
        """Who this rank sends its activations and gradients to, and receives them from, in each stage
        (megand/core/pipeline_parallel/hand_off.py; the plain pipeline peers with one width)."""
        from megand.core.pipeline_parallel.hand_off import StageHandOff

        return StageHandOff(self.layout, self.rank)

    @property
    def stage_hand_off(self):
        """:attr:`hand_off` where the stages have different widths, else None (the plain pipeline peers)."""
        return self.hand_off if self.layout.heterogeneous else None

    def sequence_parallel(self, default: bool) -> bool:
        """Whether this rank's stage runs sequence parallelism (``default``: parallel.sequence_parallel,
        where the layout has no per-stage value)."""
        return self.layout.stage_sp_of(self.pp_rank, default)

    def replica_rows(self, global_batch_size: int) -> tuple[int, int]:
        """``(first, count)``: the samples of a global batch that this rank's data-parallel replica reads."""
        return replica_rows(self.layout.dp_microbatches, self.dp_size, self.dp_rank, global_batch_size)

    def tp_run_group(self, run: int):
        """The group of the ``run`` consecutive tp ranks this rank is one of (``run`` divides tp): the ranks
        sharing a key/value head when tp exceeds the key/value heads."""
        if self.tp_size % run:
            raise LayoutError(f"no run of {run} tensor-parallel ranks: parallel.tp={self.tp_size} is not divisible by {run}")
        return self.groups["tp"] if run == self.tp_size else self.groups[f"tp_run{run}"]

    # pipeline neighbours (global ranks) and stage roles
    @property
    def pp_next_rank(self) -> int:
        return self.ranks["pp"][(self.pp_rank + 1) % self.pp_size]

    @property
    def pp_prev_rank(self) -> int:
        return self.ranks["pp"][(self.pp_rank - 1) % self.pp_size]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage_rank(self) -> int:
        """The pipeline rank holding the last virtual stage (the loss): the last rank, or rank 0 of a V."""
        return self.layout.last_stage_rank

    @property
    def tied_copies_on_one_rank(self) -> bool:
        """The first and the last virtual stage live on one pipeline rank (a V): both copies of a tied
        word embedding are there, summed locally."""
        return self.pp_size > 1 and self.last_stage_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Holds the last virtual stage (the loss): the last pp rank, or rank 0 of a V."""
        return self.pp_rank == self.last_stage_rank

    @property
    def in_embedding_group(self) -> bool:
        """Holds one of the two copies of a tied word embedding that the embedding group sums (a V
        holds both on rank 0, summed there: no group)."""
        return not self.tied_copies_on_one_rank and (self.is_first_stage or self.is_last_stage)

    @property
    def is_logging_rank(self) -> bool:
        """The one rank that writes logs and shared files: last stage, first of every other dimension."""
        return self.is_last_stage and self.tp_rank == 0 and self.cp_rank == 0 and self.dp_rank == 0

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size} tp {self.tp_rank}/{self.tp_size} cp {self.cp_rank}/{self.cp_size} "
                f"dp {self.dp_rank}/{self.dp_size} pp {self.pp_rank}/{self.pp_size} order {self.order}"
                + (f" ep {self.ep_rank}/{self.ep_size} etp {self.etp_rank}/{self.etp_size}" if self.ep > 1 else ""))


def all_decompositions(world_size: int):
    """The layout of every (tp, cp, dp, pp) whose product is ``world_size`` (for tests and tools)."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    for tp, cp, pp in itertools.product(divisors, repeat=3):
        if world_size % (tp * cp * pp) == 0:
            yield ParallelLayout.infer(world_size, tp=tp, cp=cp, pp=pp)
