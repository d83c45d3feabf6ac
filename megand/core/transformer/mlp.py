"""The feed-forward block: GELU (GPT-2) or SwiGLU (LLaMA), column- then row-parallel."""

import torch
import torch.nn.functional as F

from megand.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear


def fuse_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The fused SwiGLU fc1 weight ``[ffn * 2, hidden]`` (row pairs: gate, up) from full gate and up
    weights ``[ffn, hidden]``."""
    return torch.stack([gate, up], dim=1).reshape(-1, *gate.shape[1:])


def split_swiglu(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_swiglu`: (gate, up), each ``[ffn, hidden]``."""
    pairs = fc1.reshape(-1, 2, *fc1.shape[1:])
    return pairs[:, 0], pairs[:, 1]
class SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` of the fc1 output ``[..., f, 2]`` (gate, up), saving only that input for backward
    and recomputing the silu there: autograd on the plain expression would also keep ``silu(gate)``, one
    more f-wide activation per layer and micro-batch."""

    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        return F.silu(h[..., 0]) * h[..., 1]

    @staticmethod
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        gate, up = h[..., 0], h[..., 1]
        out = torch.empty_like(h)  # [..., f, 2], written in place: no stack of the two halves
        # silu's own backward kernel: silu'(x) = sig(x) (1 + x (1 - sig(x))) in one pass
        torch.ops.aten.silu_backward(grad * up, gate, grad_input=out[..., 0])
        torch.mul(grad, F.silu(gate), out=out[..., 1])
        return out


class MLP(torch.nn.Module):
    """For SwiGLU the fused input weight is laid out ``[ffn, 2, hidden]`` (gate and up rows interleaved,
    see :func:`fuse_swiglu`), so an even split across tp gives each rank matching gate and up rows whatever
    tp is."""

    def __init__(self, cfg, topo, device=None):
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        if cfg.activation not in ("gelu", "swiglu"):
            raise ValueError(f"model.activation={cfg.activation!r}: expected gelu or swiglu")
        common = dict(tp_group=topo.tp_group, bias=cfg.add_bias, sequence_parallel=cfg.sequence_parallel,
                      dtype=cfg.params_dtype, device=topo.device if device is None else device)
        fc1_size = cfg.ffn_hidden_size * (2 if self.swiglu else 1)
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, fc1_size, init_std=cfg.init_std, **common)
        self.fc2 = RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size,
                                     init_std=cfg.init_std / (2 * cfg.num_layers) ** 0.5, **common)

    def forward(self, x):
        h = self.fc1(x)
        if self.swiglu:
            h = SwiGLU.apply(h.unflatten(-1, (-1, 2)))
        else:
            h = F.gelu(h, approximate="tanh")
        return self.fc2(h)
