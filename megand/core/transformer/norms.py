"""LayerNorm and RMSNorm whose weights are replicated across tensor-parallel ranks."""

import torch
import torch.nn.functional as F

from megand.core.sharding import NORM, ParamMeta, tag


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
