"""LayerNorm and RMSNorm whose weights are replicated across tensor-parallel ranks."""

import torch
import torch.nn.functional as F

from megand.core.sharding import NORM, ParamMeta, tag
from megand.core.tensor_parallel.mappings import all_reduce_both


class Norm(torch.nn.Module):
    """``kind`` is layernorm (weight and bias) or rmsnorm (weight only).

    ``input_split``: how the normalised input is split over tp (:class:`ParamMeta`): under sequence
    parallelism each tp rank normalises a different sequence shard ("tokens"); a per-head norm sees only
    the rank's own heads ("heads"). Either way the weight gradient is partial: the tag tells the optimizer
    to sum it over tp. ``unit_offset``: an RMSNorm that scales by ``1 + weight`` (the weight stored as the
    difference from 1, zero at init; Qwen3-Next), so checkpoints keep the published values.
    """

    def __init__(self, kind, hidden_size, *, eps=1e-5, input_split=None, tp_rank=0, tp_size=1,
                 dtype=torch.float32, device=None, unit_offset=False):
        super().__init__()
        if kind not in ("layernorm", "rmsnorm"):
            raise ValueError(f"model.norm={kind!r}: expected layernorm or rmsnorm")
        self.kind, self.eps, self.shape, self.unit_offset = kind, eps, (hidden_size,), unit_offset
        if unit_offset and kind != "rmsnorm":
            raise ValueError(f"model.norm_unit_offset=true with model.norm={kind}: only RMSNorm has it")

        def param(init):
            meta = ParamMeta(self.shape, None, tp_rank, tp_size, init=init, input_split=input_split, role=NORM)
            return tag(torch.nn.Parameter(torch.empty(self.shape, dtype=dtype, device=device)), meta)

        self.weight = param("zeros" if unit_offset else "ones")
        self.bias = param("zeros") if kind == "layernorm" else None

    def forward(self, x):
        if self.kind == "layernorm":
            return F.layer_norm(x, self.shape, self.weight, self.bias, self.eps)
        if self.unit_offset:  # as transformers: normalised in fp32, times (1 + w) in fp32, then the input's dtype
            return (F.rms_norm(x.float(), self.shape, eps=self.eps) * (1.0 + self.weight.float())).to(x.dtype)
        return F.rms_norm(x, self.shape, self.weight, self.eps)


class SplitRMSNorm(torch.nn.Module):
    """An RMSNorm over a width split over tp (OLMo 2/3's q/k norm over all query heads, all key heads): each rank
    holds its slice of the weight ``[width / tp]`` (its heads' channels) and the mean of squares sums the
    ranks' parts (all-reduced, its gradient too). As transformers: normalised in fp32, times the weight in
    fp32, then the input's dtype."""

    def __init__(self, width, *, eps, tp_group, tp_rank=0, tp_size=1, dtype=torch.float32, device=None):
        super().__init__()
        self.width, self.eps, self.tp_group = width, eps, tp_group
        meta = ParamMeta((width,), 0, tp_rank, tp_size, init="ones", role=NORM)
        self.weight = tag(torch.nn.Parameter(torch.empty((width // tp_size,), dtype=dtype, device=device)), meta)

    def forward(self, x):
        """``x [..., heads_local, d]``: this rank's heads."""
        flat = x.flatten(-2).float()
        squares = flat.pow(2).sum(-1, keepdim=True)
        if self.tp_group is not None:
            squares = all_reduce_both(squares, self.tp_group)
        out = self.weight.float() * (flat * torch.rsqrt(squares / self.width + self.eps))
        return out.to(x.dtype).view_as(x)
