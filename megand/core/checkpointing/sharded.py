"""Layout-free state: every local tensor becomes pieces of its FULL tensor (pieces.py writes and reads them).

A parameter's :class:`~megand.core.sharding.ParamMeta` says which slice of the full tensor this rank
holds; its local shard (without vocab padding rows) is one piece at that slice's offset. An optimizer
state shard (``Optimizer.sharded_state_dict``) is a flat range ``[lo, hi)`` of the local parameter:
it becomes the few boxes that range covers, shifted to the full tensor. Keys are the full model's
names, so pipeline stages and model chunks need no special handling:

    model.<param name>                             the parameter
    model.<buffer name>                            a persistent buffer (state that is not trained, e.g. the
                                                   MoE router's balancing bias): whole, identical on its ranks
    optim.<param name>.<state name|main>           its optimizer state (fp32; the state names of its optimizer
                                                   record, e.g. AdamW's exp_avg, exp_avg_sq; ``main`` only for
                                                   non-fp32 runs)

Nothing is gathered and nothing full-size is built: saving writes views of the live state (host
copies of device tensors, and copies for an asynchronous save: staging.py), loading reads straight into the parameters and the optimizer's state.
Under ZeRO-3 the parameters themselves are flat ranges too (the engine's packed slices), written and
read like an optimizer shard.
The weights and their fp32 master copy load from ``optim.<name>.main`` when the checkpoint has one,
else from the model weights at the precision they were stored in (a model-only or fp32 checkpoint).
A tied copy (``meta.copy_of``) is never saved; it loads from its original's keys. A part of a fused tensor
(``meta.part_of``) is saved and loaded under that tensor's keys; a slice replicated over a run of tp ranks
(``meta.tp_replicas``: a shared key/value head) is written by the first of them only and read by all.
"""

from __future__ import annotations

import torch

from megand.core.checkpointing.pieces import Piece, flat_range_boxes
from megand.core.host_reads import holds_values
from megand.core.sharding import ParamMeta, full_name


def unpadded(local: torch.Tensor, meta: ParamMeta) -> torch.Tensor:
    """The rows of ``local`` that belong to the full tensor (drops vocab padding)."""
    if meta.split_dim is None:
        return local
    piece = meta.local_slice()[meta.split_dim]
    return local.narrow(meta.split_dim, 0, piece.stop - piece.start)


def unpadded_shape(shape, meta: ParamMeta) -> tuple[int, ...]:
    """The shape of :func:`unpadded` (read from the metadata: a ZeRO-3 parameter holds no storage)."""
    if meta.split_dim is None:
        return tuple(shape)
    piece = meta.local_slice()[meta.split_dim]
    return tuple(piece.stop - piece.start if d == meta.split_dim else n for d, n in enumerate(shape))


def tp_offset(meta: ParamMeta) -> tuple[int, ...]:
    """Where this rank's (unpadded) local shard starts in the full tensor."""
    return tuple(s.start or 0 for s in meta.local_slice())


def saved_name(name: str, meta: ParamMeta) -> str:
    return full_name(name, meta)


def written(meta: ParamMeta) -> bool:
    """Whether this rank writes the parameter: not a tied copy, and the first copy of a replicated head."""
    return meta.copy_of is None and (meta.tp_replicas == 1 or meta.first_replica)


def model_key(name: str) -> str:
    return f"model.{name}"


def optim_key(name: str, state: str) -> str:
    return f"optim.{name}.{state}"


def param_piece(key: str, param: torch.nn.Parameter) -> Piece:
    """The parameter's local shard as a piece: a view of its data (loading writes into the parameter)."""
    meta = param.meta
    return Piece(key, tp_offset(meta), tuple(meta.full_shape), unpadded(param.detach(), meta))


def flat_pieces(key: str, param: torch.Tensor, lo: int, hi: int, flat: torch.Tensor) -> list[Piece]:
    """``flat`` (elements ``[lo, hi)`` of the flattened local ``param``) as pieces of the full tensor:
    views of ``flat``, padding rows left out."""
    meta = param.meta
    start = tp_offset(meta)
    keep = unpadded_shape(param.shape, meta)
    out = []
    for offsets, sizes, first in flat_range_boxes(lo, hi, param.shape):
        view = flat[first - lo: first - lo + int(torch.Size(sizes).numel())].view(sizes)
        for d in range(len(sizes)):  # clip to the unpadded rows (only the split dim is ever padded)
            stop = min(offsets[d] + sizes[d], keep[d])
            view = view.narrow(d, 0, max(0, stop - offsets[d]))
        if view.numel():
            out.append(Piece(key, tuple(o + s for o, s in zip(offsets, start)), tuple(meta.full_shape), view))
    return out


def exact_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a contiguous CPU view) as a tensor sharing its memory whose storage is exactly its bytes.

    DCP's file writer copies every tensor whose storage is larger than the tensor (any view into our
    flat buffers) and keeps the copies until the rank's file is written: a second copy of everything the
    rank writes. A storage of its own (through numpy, which makes no copy) lets it write the view as is."""
    if not holds_values(t):  # e.g. the fake tensors of a rehearsal: no numpy view
        return t
    if t.device.type != "cpu" or not t.is_contiguous() or t.untyped_storage().nbytes() == t.nbytes or not t.numel():
        return t
    return torch.from_numpy(t.reshape(-1).view(torch.uint8).numpy()).view(t.dtype).view(t.shape)


def weight_pieces(named_params, ddp, key_of) -> list[Piece]:
    """Every parameter's pieces under ``key_of(name, param)`` (left out where it is None): the local
    shard whole, or under ZeRO-3 (``ddp.shard_params``) this rank's flat slices of it, views of the
    engine's packed buffer: outside a forward those are the only values a ZeRO-3 rank holds, and reading
    them gathers nothing."""
    if not ddp.shard_params:  # a rank whose vocab rows are all padding holds no piece of that tensor
        pieces = [param_piece(key, p) for name, p in named_params if (key := key_of(name, p)) is not None]
        return [piece for piece in pieces if piece.tensor.numel()]
    name_of = {p: n for n, p in named_params}
    return [piece for p, lo, hi, data in ddp.param_shards() if (key := key_of(name_of[p], p)) is not None
            for piece in flat_pieces(key, p, lo, hi, data)]


def state_buffers(modules) -> list[tuple[str, torch.Tensor]]:
    """The persistent buffers of ``modules`` (model chunks) by their full-model names: saved whole."""
    out = []
    for module in modules:
        out += [(name, buf) for name, buf in module.state_dict(keep_vars=True).items()
                if not isinstance(buf, torch.nn.Parameter)]
    return out


def buffer_pieces(named_buffers) -> list[Piece]:
    return [Piece(model_key(n), (0,) * b.ndim, tuple(b.shape), b.detach()) for n, b in named_buffers]


def save_pieces(named_params, optimizer, named_buffers=()) -> list[Piece]:
    """This rank's pieces of the model and optimizer state: views of the live tensors, where they live
    (``staging.HostStaging`` makes the host copies the writer needs).

    Under hybrid sharding the replicas of a shard group hold the same shards: only the first replica
    writes them (the weights of a level below ZeRO-3 are whole on every rank; DCP keeps one copy)."""
    ddp = optimizer.ddp
    writes_shards = ddp.replica_rank == 0
    pieces = []
    if writes_shards or not ddp.shard_params:
        pieces += weight_pieces(named_params, ddp,
                                lambda n, p: model_key(saved_name(n, p.meta)) if written(p.meta) else None)
    for shard in optimizer.sharded_state_dict() if writes_shards else ():
        if written(shard.param.meta):
            for kind, flat in shard.tensors.items():
                pieces += flat_pieces(optim_key(saved_name(shard.name, shard.param.meta), kind), shard.param,
                                      shard.lo, shard.hi, flat)
    return pieces + buffer_pieces(named_buffers)


def expected_full_shapes(named_params, optimizer, named_buffers=()) -> dict[str, tuple[int, ...]]:
    """Every key this rank may read, with the full shape it must have in the checkpoint."""
    shapes = {model_key(n): tuple(b.shape) for n, b in named_buffers}
    for name, p in named_params:  # the weights, and the fp32 master copy they may be read from
        for key in (model_key(saved_name(name, p.meta)), optim_key(saved_name(name, p.meta), "main")):
            shapes[key] = tuple(p.meta.full_shape)
    for shard in optimizer.sharded_state_dict():
        meta = shard.param.meta
        for kind in shard.tensors:
            shapes[optim_key(saved_name(shard.name, meta), kind)] = tuple(meta.full_shape)
    return shapes


def load_pieces(named_params, optimizer, keys: set[str], with_optimizer: bool, named_buffers=()) -> list[Piece]:
    """Where each piece of the checkpoint goes, in place: every parameter and its fp32 master copy (where
    separate) from the saved ``main`` if there is one (the most precise copy: an fp32 run resumed from a
    bf16 one keeps it), else from the model weights; the Adam moments only ``with_optimizer``."""

    def weights(original):
        main = optim_key(original, "main")
        return main if main in keys else model_key(original)

    pieces = weight_pieces(named_params, optimizer.ddp, lambda n, p: weights(saved_name(n, p.meta)))
    for shard in optimizer.sharded_state_dict():
        original = saved_name(shard.name, shard.param.meta)
        for kind, flat in shard.tensors.items():
            if kind == "main":
                key = weights(original)
            elif with_optimizer:
                key = optim_key(original, kind)
            else:
                continue
            pieces += flat_pieces(key, shard.param, shard.lo, shard.hi, flat)
    return pieces + buffer_pieces(named_buffers)
