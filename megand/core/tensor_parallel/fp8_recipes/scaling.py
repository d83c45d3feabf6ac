"""What the FP8 recipes' quantisers share: the element formats, and dynamic amax scaling (the amax of the
current tensor, agreed over the ranks whose shards must scale alike), its two passes compiled on a GPU."""

from __future__ import annotations

import torch
import torch.distributed as dist

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_TINY = 1e-12  # an all-zero tensor's amax: any positive scale quantises it to zeros


def fmax(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def _agreed_max(amax: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        amax = amax.contiguous()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def _amax(t: torch.Tensor, dim: int | None) -> torch.Tensor:
    """``|t|``'s maximum, in fp32: of the whole tensor (``dim`` None) or along ``dim`` (kept)."""
    magnitude = t.abs()
    return (magnitude.amax() if dim is None else magnitude.amax(dim=dim, keepdim=True)).float()


def _cast(t: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype):
    """``(data, scale)``: ``t`` divided by the scale ``amax / fmax``, saturated and rounded to ``dtype``."""
    scale = amax.clamp(min=_TINY) / fmax(dtype)
    return (t.float() / scale).clamp(-fmax(dtype), fmax(dtype)).to(dtype), scale


# the quantiser's two passes compiled (on a GPU; made at first use): shapes dynamic, so what recompiles
# them is only the axis (3 of _amax), the format and the scale's rank (6 of _cast), within dynamo's limit
_FUSED = {}


def _fused(fn):
    if fn not in _FUSED:
        _FUSED[fn] = torch.compile(fn, dynamic=True, fullgraph=True)
    return _FUSED[fn]


def _on_gpu(t: torch.Tensor) -> bool:
    """Whether ``t``'s quantisation runs compiled: a real CUDA tensor outside a compiled region (fake CUDA
    tensors of a rehearsal, and the CPU, run the same functions eagerly)."""
    from torch._subclasses.fake_tensor import is_fake

    return t.is_cuda and not torch.compiler.is_compiling() and not is_fake(t)


def amax_quantize(t: torch.Tensor, dtype: torch.dtype, dim: int | None, group=None):
    """``(data, scale)``: ``t`` with one fp32 scale ``amax / fmax`` over the whole tensor (``dim`` None) or per
    slice along ``dim``, the amax agreed over ``group``. Two passes over ``t`` (the amax, then the scaled
    cast), each compiled on a GPU (its elementwise steps fused) and eager elsewhere, with the same arithmetic."""
    amax_of, cast = (_fused(_amax), _fused(_cast)) if _on_gpu(t) else (_amax, _cast)
    return cast(t, _agreed_max(amax_of(t, dim), group), dtype)
