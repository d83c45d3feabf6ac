"""Parameters tagged with how they are sharded (nanotron's idea).

Every parameter carries a :class:`ParamMeta`: the full tensor it is a slice of, the dimension split
across tensor-parallel ranks, how the full tensor is initialised, and whether it is a copy of another
parameter. From that one tag follow layout-independent initialisation, grad-norm de-duplication,
sequence-parallel gradient reduction, tied-weight synchronisation and resharding checkpoints.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import zlib
from dataclasses import dataclass

import torch


# A parameter's role in the model, declared where the parameter is made. Optimizers choose the parameters
# they take by role (never by name or shape), and weight decay applies to every role but norms and biases.
MATRIX = "matrix"                # a weight matrix of a layer: attention, MLP, shared experts, MTP projection
EXPERT_MATRIX = "expert_matrix"  # the routed experts' stacked matrices [E, out, in]
EMBEDDING = "embedding"          # the word and position embeddings; a later stage's copy of the word embedding
OUTPUT = "output"                # the output layer (untied from the word embedding)
CONV = "conv"                    # a depthwise convolution's taps [channels, K] (Gated DeltaNet): no matrix
ROUTER = "router"                # gating weights: the MoE router, the shared experts' gate
NORM = "norm"                    # norm weights and biases
BIAS = "bias"                    # the biases of linear layers and experts
ROLES = (MATRIX, EXPERT_MATRIX, EMBEDDING, OUTPUT, ROUTER, NORM, BIAS, CONV)
UNDECAYED_ROLES = frozenset({NORM, BIAS})


@dataclass(frozen=True)
class ParamMeta:
    full_shape: tuple[int, ...]  # the full, unpadded tensor
    split_dim: int | None = None  # dim split across tp; None: replicated on every tp rank
    tp_rank: int = 0
    tp_size: int = 1
    init: str = "normal"  # normal | ones | zeros
    init_std: float = 0.02
    # How the input of a parameter replicated across tp is split over the tp ranks, declared where the
    # parameter is made: "tokens" (sequence shards under sequence parallelism, or each rank's share of
    # routed tokens: norm weights, biases after a reduce-scatter) or "heads" (each rank holds other
    # attention heads: the per-head q/k norms, at any tp > 1). Either way each tp rank's gradient is partial
    # and is summed over tp before the optimizer. None: every tp rank sees the whole input.
    input_split: str | None = None
    copy_of: str | None = None  # name of the parameter this one duplicates (tied output layer on the last stage)
    # One of the two copies of a weight tied across pipeline stages (word embedding and output layer):
    # their gradients are summed over the embedding group so the copies stay equal.
    embedding_group_grad: bool = False
    # The split dim's length with padding (the vocab padded to a multiple of tp): every rank holds
    # padded_size / tp_size rows, of which the ones beyond the full tensor are padding. None: the full
    # length rounded up to a multiple of tp_size.
    padded_size: int | None = None
    # A routed expert's tensor ([num_experts, ...]): its gradient is summed over the expert-data-parallel
    # group, and dim 0 (the experts) is split evenly over the ep expert-parallel ranks.
    expert: bool = False
    ep_rank: int = 0
    ep_size: int = 1
    # A fused weight (QKV, SwiGLU's gate and up): the rows of each logical matrix in one unit that repeats
    # along the out dim (dim -2), e.g. (q rows, k rows, v rows) per query group; None: one matrix
    fused_rows: tuple[int, ...] | None = None
    role: str | None = None  # one of ROLES; None only for a parameter no optimizer will take
    # A part of a fused tensor held in pieces: the rows ``[start, stop)`` of the full tensor's dim 0 this rank
    # holds (None: its shard along ``split_dim``), and the name of that full tensor within the parameter's
    # module (``part_of``: e.g. "weight" for a module's ``kv_weight``). The multi-query projection holds its
    # query rows and its key/value rows of the one fused QKV weight as two parameters.
    rows: tuple[int, int] | None = None
    part_of: str | None = None
    # Consecutive tp ranks holding the same slice (a key/value head that the query heads of several tp ranks
    # share): each holds a partial gradient, summed over exactly those ranks (``Topology.tp_run_group``); the
    # first of them counts it in the grad norm and writes it to checkpoints. 1: no replication over a subgroup.
    tp_replicas: int = 1

    def __post_init__(self):
        if self.role is not None and self.role not in ROLES:
            raise ValueError(f"ParamMeta.role={self.role!r}: expected one of {', '.join(ROLES)}")

    @property
    def decays(self) -> bool:
        """Whether decoupled weight decay applies (every role but norms and biases)."""
        return self.role not in UNDECAYED_ROLES

    def local_slice(self) -> tuple[slice, ...]:
        """This rank's slice of the full tensor. Along a padded dim (vocab) it may hold fewer rows than
        the local parameter (none at all when its rows are all padding); the rest is padding. An expert
        tensor holds experts ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)`` of dim 0 (never padded)."""
        region = [slice(None) for _ in self.full_shape]
        if self.rows is not None:
            region[0] = slice(*self.rows)
        elif self.split_dim is not None:
            full = self.full_shape[self.split_dim]
            per_rank = (self.padded_size or full + (-full) % self.tp_size) // self.tp_size
            start = min(self.tp_rank * per_rank, full)
            region[self.split_dim] = slice(start, min(start + per_rank, full))
        if self.ep_size > 1:
            per_rank = self.full_shape[0] // self.ep_size
            region[0] = slice(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)
        return tuple(region)

    @property
    def partial_over_tp(self) -> bool:
        """Whether each tp rank holds a partial gradient of this replicated parameter (summed over tp)."""
        return self.split_dim is None and self.input_split is not None

    @property
    def first_replica(self) -> bool:
        """Whether this rank holds the first copy of its slice over tp (it counts and writes it)."""
        if self.split_dim is None:
            return self.tp_rank == 0
        return self.tp_rank % self.tp_replicas == 0

    @property
    def counted_in_norm(self) -> bool:
        """Whether this rank counts the parameter in the global norm: every element counts once over tp."""
        return self.copy_of is None and self.first_replica


def full_name(name: str, meta: ParamMeta) -> str:
    """The name of the full tensor the parameter ``name`` holds a slice of: the original of a tied copy, the
    fused tensor a part belongs to (``meta.part_of``, in the same module), else its own."""
    if meta.copy_of:
        return meta.copy_of
    if meta.part_of:
        return f"{name.rpartition('.')[0]}.{meta.part_of}".lstrip(".")
    return name


TOKENS, HEADS = "tokens", "heads"  # ParamMeta.input_split


def split_by_tokens(sharded: bool) -> str | None:
    """``input_split`` of a replicated parameter whose input is sequence-sharded over tp when ``sharded``."""
    return TOKENS if sharded else None


def tag(param: torch.nn.Parameter, meta: ParamMeta) -> torch.nn.Parameter:
    param.meta = meta
    return param


def meta_of(param: torch.Tensor) -> ParamMeta:
    return param.meta


def retag(param: torch.nn.Parameter, **changes) -> None:
    param.meta = dataclasses.replace(param.meta, **changes)


# Initialisation draws the full tensor tile by tile: a fixed grid over the FULL shape (independent of
# the layout), each tile drawn from its own generator seeded by (seed, parameter name, tile index).
# A rank draws only the tiles its slice overlaps, so init costs about 1/tp of the full tensor per rank
# and every layout sees the same values.
TILE_1D = 65536  # elements per tile of a 1-D tensor
TILE_2D = (256, 256)  # rows x columns per tile of a matrix (further dims, if any, stay whole)


def tile_shape(full_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Vectors: 1-D tiles; matrices: 2-D tiles; a stack of matrices (the experts' ``[E, rows, cols]``):
    2-D tiles of each matrix, so a shard along any dimension draws about its own share."""
    if len(full_shape) == 1:
        return (TILE_1D,)
    return (1,) * (len(full_shape) - 2) + TILE_2D


def tile_seed(seed: int, name: str, index: int) -> int:
    # 32 bits: all the CPU generator (mt19937) uses of a seed
    return zlib.crc32(f"{seed}/{name}/{index}".encode())


def draw_region(meta: ParamMeta, seed: int, name: str, region: tuple[slice, ...], out: torch.Tensor,
                staged: bool | None = None) -> None:
    """Write ``full[region]`` of the full tensor ``name`` into ``out`` (of the region's shape), drawing
    only the tiles that overlap the region. Tiles are drawn in fp32 on the CPU, whatever the device.

    Into a device tensor (``staged``, default: ``out`` not on the CPU) the tiles are drawn into host memory
    a band at a time (the tiles sharing all but their last grid coordinate: a row of 256 x 256 tiles),
    and each band is copied in one piece, from pinned memory without blocking on CUDA: one copy per band,
    not one blocking copy per tile. The values are the same either way."""
    if meta.init in ("ones", "zeros"):
        out.fill_(1.0 if meta.init == "ones" else 0.0)
        return
    staged = out.device.type != "cpu" if staged is None else staged
    pinned = staged and out.device.type == "cuda" and torch.cuda.is_available()
    full, tile = meta.full_shape, tile_shape(meta.full_shape)
    bounds = [(r.start or 0, n if r.stop is None else r.stop) for r, n in zip(region, full)]
    counts = [-(-n // t) for n, t in zip(full, tile)]
    grid = [range(lo // t, -(-hi // t)) for (lo, hi), t in zip(bounds, tile)]
    scratch = torch.empty(math.prod(tile), dtype=torch.float32)
    whole_tile = scratch.view(tile)
    generator = torch.Generator()
    for band in itertools.product(*grid[:-1]):
        # the band's box: its tiles' extent in the leading dims, the whole region along the last one
        band_lo = [max(c * t, lo) for c, t, (lo, _) in zip(band, tile, bounds)] + [bounds[-1][0]]
        band_hi = [min((c + 1) * t, hi) for c, t, (_, hi) in zip(band, tile, bounds)] + [bounds[-1][1]]
        band_out = out[tuple(slice(l - b, h - b) for l, h, (b, _) in zip(band_lo, band_hi, bounds))]
        target = torch.empty(band_out.shape, dtype=torch.float32, pin_memory=pinned) if staged else band_out
        for last in grid[-1]:
            coord = (*band, last)
            index = 0
            for c, n in zip(coord, counts):
                index = index * n + c
            t_lo = [c * t for c, t in zip(coord, tile)]
            t_hi = [min(lo + t, n) for lo, t, n in zip(t_lo, tile, full)]
            t_shape = [h - l for l, h in zip(t_lo, t_hi)]
            drawn = whole_tile if t_shape == list(tile) else scratch[: math.prod(t_shape)].view(t_shape)
            drawn.normal_(0.0, meta.init_std, generator=generator.manual_seed(tile_seed(seed, name, index)))
            lo = [max(a, b) for a, (b, _) in zip(t_lo, bounds)]
            hi = [min(a, b) for a, (_, b) in zip(t_hi, bounds)]
            if lo != t_lo or hi != t_hi:  # the region cuts this tile
                drawn = drawn[tuple(slice(l - t, h - t) for l, h, t in zip(lo, hi, t_lo))]
            target[tuple(slice(l - b, h - b) for l, h, b in zip(lo, hi, band_lo))].copy_(drawn)
        if staged:  # pinned memory stays reserved until its non-blocking copy has run
            band_out.copy_(target, non_blocking=pinned)


def flat_range_boxes(lo: int, hi: int, shape) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Elements ``[lo, hi)`` of a row-major tensor of ``shape`` as boxes ``(offsets, sizes, flat start)``.

    Each box is a contiguous run of the flat range (so a view of it), starting at ``flat start``."""
    shape = tuple(shape)
    if lo >= hi:
        return []
    if len(shape) == 0:
        return [((), (), lo)]
    if len(shape) == 1:
        return [((lo,), (hi - lo,), lo)]
    inner = math.prod(shape[1:])

    def in_row(row, a, b):  # [a, b) inside one row
        return [((row, *o), (1, *s), row * inner + f) for o, s, f in flat_range_boxes(a, b, shape[1:])]

    first, last = lo // inner, (hi - 1) // inner
    if first == last:
        return in_row(first, lo - first * inner, hi - first * inner)
    boxes = []
    if lo % inner:
        boxes += in_row(first, lo % inner, inner)
        first += 1
    full_end = hi // inner
    if full_end > first:
        boxes.append(((first,) + (0,) * (len(shape) - 1), (full_end - first, *shape[1:]), first * inner))
    if hi % inner:
        boxes += in_row(full_end, 0, hi % inner)
    return boxes


def full_init(meta: ParamMeta, seed: int, name: str) -> torch.Tensor:
    """The full tensor that ``name`` is a slice of, identical whatever the layout (tests and tools)."""
    full = torch.empty(meta.full_shape)
    draw_region(meta, seed, name, tuple(slice(None) for _ in meta.full_shape), full)
    return full


@torch.no_grad()
def init_parameters(module: torch.nn.Module, seed: int) -> None:
    """Fill every tagged parameter, in place, with its slice of the full tensor drawn from (seed, name).

    Only the tiles overlapping this rank's slice are drawn (see :func:`draw_region`). A copy
    (``copy_of``) draws from its original's name, so tied weights start equal. Padding rows beyond the
    full tensor are zero. The parameters must be materialised (not on the meta device).
    """
    for name, param in module.named_parameters():
        if param.is_meta:
            raise ValueError(f"init_parameters: {name} is still on the meta device; materialise it first")
        meta = meta_of(param)
        region = meta.local_slice()
        local_shape = [len(range(*s.indices(n))) for s, n in zip(region, meta.full_shape)]
        if tuple(local_shape) != tuple(param.shape):
            param.zero_()  # vocab padding beyond the full tensor
        draw_region(meta, seed, full_name(name, meta), region, param[tuple(slice(0, n) for n in local_shape)])


@torch.no_grad()
def init_flat_range(param: torch.Tensor, name: str, seed: int, lo: int, hi: int, out: torch.Tensor) -> None:
    """Write elements ``[lo, hi)`` of the flattened local ``param``, as :func:`init_parameters` would
    initialise them, into the 1-D ``out``, without touching ``param`` (which may hold no storage: under
    ZeRO-3 a rank keeps only such flat ranges of its parameters). Only the tiles overlapping the range
    are drawn; vocab padding rows are zero."""
    meta = meta_of(param)
    region = meta.local_slice()
    start = [s.start or 0 for s in region]
    keep = [len(range(*s.indices(n))) for s, n in zip(region, meta.full_shape)]  # the unpadded local shape
    for offsets, sizes, first in flat_range_boxes(lo, hi, param.shape):
        box = out[first - lo: first - lo + math.prod(sizes)].view(sizes)
        inside = [max(0, min(o + n, k) - o) for o, n, k in zip(offsets, sizes, keep)]
        if inside != list(sizes):
            box.zero_()  # vocab padding beyond the full tensor
        if all(inside):
            draw_region(meta, seed, full_name(name, meta),
                        tuple(slice(s + o, s + o + n) for s, o, n in zip(start, offsets, inside)),
                        box[tuple(slice(0, n) for n in inside)])
