"""Layout-free state dicts: every local tensor becomes a piece of its FULL tensor.

A parameter's :class:`~megand.core.sharding.ParamMeta` says which slice of the full tensor this rank
holds. Here each local shard (without vocab padding rows) is wrapped as a DTensor on a 1-D mesh over
the tensor-parallel group: ``Shard(split_dim)`` for split parameters, ``Replicate()`` otherwise.
torch.distributed.checkpoint then records each piece with its global offset, keeps one copy of
pieces replicated over dp/cp/tp, and on load reads whatever overlaps the piece the new layout needs.
Keys are the full model's names, so pipeline stages and model chunks need no special handling:

    model.<param name>                       the parameter
    optim.<param name>.<exp_avg|exp_avg_sq|main>   its optimizer state (local tp-shard shapes)

A tied copy (``meta.copy_of``) is never saved; it loads from its original's keys.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from megand.core.sharding import ParamMeta


def contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def unpadded(local: torch.Tensor, meta: ParamMeta) -> torch.Tensor:
    """The rows of ``local`` that belong to the full tensor (drops vocab padding)."""
    if meta.split_dim is None:
        return local
    piece = meta.local_slice()[meta.split_dim]
    return local.narrow(meta.split_dim, 0, piece.stop - piece.start)


def tp_mesh(topo) -> DeviceMesh:
    """A 1-D mesh over this rank's tensor-parallel group (only metadata: DCP reads coordinates from it)."""
    return DeviceMesh.from_group(topo.tp_group, "cpu")


def as_piece(local: torch.Tensor, meta: ParamMeta, mesh: DeviceMesh) -> DTensor:
    """``local`` (a CPU tensor with the unpadded local shape) as this rank's piece of the full tensor."""
    placement = Replicate() if meta.split_dim is None else Shard(meta.split_dim)
    return DTensor.from_local(local, mesh, [placement], run_check=False, shape=torch.Size(meta.full_shape),
                              stride=contiguous_stride(meta.full_shape))


def saved_name(name: str, meta: ParamMeta) -> str:
    return meta.copy_of or name


def model_key(name: str) -> str:
    return f"model.{name}"


def optim_key(name: str, state: str) -> str:
    return f"optim.{name}.{state}"


def save_state(named_params, optimizer, mesh, copy: bool) -> dict[str, DTensor]:
    """This rank's pieces of the model and optimizer state, on CPU (cloned if ``copy``, so training may go
    on mutating the originals while they are written in the background)."""

    def staged(t, meta):
        t = unpadded(t.detach(), meta)
        t = t.to("cpu", copy=copy) if t.device.type != "cpu" else (t.clone() if copy else t)
        return as_piece(t, meta, mesh)

    state = {}
    metas = dict(named_params)
    for name, param in named_params:
        if param.meta.copy_of is None:
            state[model_key(name)] = staged(param, param.meta)
    for name, states in optimizer.state_dict_per_param().items():
        meta = metas[name].meta
        if meta.copy_of is None:
            for kind, tensor in states.items():
                state[optim_key(name, kind)] = staged(tensor, meta)
    return state


def expected_full_shapes(named_params, optim_template) -> dict[str, tuple[int, ...]]:
    """Every key this rank will read, with the full shape it must have in the checkpoint."""
    metas = dict(named_params)
    shapes = {model_key(saved_name(n, p.meta)): tuple(p.meta.full_shape) for n, p in named_params}
    for name, states in optim_template.items():
        meta = metas[name].meta
        for kind in states:
            shapes[optim_key(saved_name(name, meta), kind)] = tuple(meta.full_shape)
    return shapes


def load_buffers(named_params, optim_template, mesh, keys: set[str]):
    """Empty CPU pieces to load into: ``(state, model_targets, optim_targets)``. ``keys`` are the keys present
    in the checkpoint; optimizer states absent from it are left out (the caller decides what that means).
    When the checkpoint has an fp32 ``main`` copy of a parameter, the model weight is read from it."""
    metas = dict(named_params)
    state, model_targets, optim_targets = {}, {}, {}

    def piece(key, meta, dtype):
        if key not in state:
            shape = list(meta.full_shape)
            if meta.split_dim is not None:
                s = meta.local_slice()[meta.split_dim]
                shape[meta.split_dim] = s.stop - s.start
            state[key] = as_piece(torch.empty(shape, dtype=dtype), meta, mesh)
        return key

    for name, param in named_params:
        original = saved_name(name, param.meta)
        main = optim_key(original, "main")
        source = main if main in keys else model_key(original)
        model_targets[name] = piece(source, param.meta, torch.float32 if source == main else param.dtype)
    for name, states in optim_template.items():
        meta = metas[name].meta
        for kind, tensor in states.items():
            key = optim_key(saved_name(name, meta), kind)
            if key in keys:
                optim_targets.setdefault(name, {})[kind] = piece(key, meta, tensor.dtype)
    return state, model_targets, optim_targets


@torch.no_grad()
def copy_into(local: torch.Tensor, value: torch.Tensor, meta: ParamMeta) -> None:
    """Copy an unpadded local piece into ``local`` (padding rows are left as they are)."""
    unpadded(local, meta).copy_(value.to(local.device, local.dtype))


def padded_like(template: torch.Tensor, value: torch.Tensor, meta: ParamMeta) -> torch.Tensor:
    """``value`` placed into a zero tensor shaped like ``template`` (re-adds vocab padding)."""
    out = torch.zeros_like(template)
    copy_into(out, value, meta)
    return out
