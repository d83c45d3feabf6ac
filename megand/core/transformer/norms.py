"""LayerNorm and RMSNorm whose weights are replicated across tensor-parallel ranks."""

import torch
import torch.nn.functional as F

from megand.core.sharding import NORM, ParamMeta, tag


class Norm(torch.nn.Module):
    """``kind`` is layernorm (weight and bias) or rmsnorm (weight only).

    ``input_split``: how the normalised input is split over tp (:class:`ParamMeta`): under sequence
    parallelism each tp rank normalises a different sequence shard ("tokens"); a per-head norm sees only
    the rank's own heads ("heads"). Either way the weight gradient is partial: the tag tells the optimizer
    to sum it over tp.
    """

    def __init__(self, kind, hidden_size, *, eps=1e-5, input_split=None, tp_rank=0, tp_size=1,
                 dtype=torch.float32, device=None):
        super().__init__()
        if kind not in ("layernorm", "rmsnorm"):
            raise ValueError(f"model.norm={kind!r}: expected layernorm or rmsnorm")
        self.kind, self.eps, self.shape = kind, eps, (hidden_size,)

        def param(init):
            meta = ParamMeta(self.shape, None, tp_rank, tp_size, init=init, input_split=input_split, role=NORM)
            return tag(torch.nn.Parameter(torch.empty(self.shape, dtype=dtype, device=device)), meta)

        self.weight = param("ones")
        self.bias = param("zeros") if kind == "layernorm" else None

    def forward(self, x):
        if self.kind == "layernorm":
            return F.layer_norm(x, self.shape, self.weight, self.bias, self.eps)
        return F.rms_norm(x, self.shape, self.weight, self.eps)
