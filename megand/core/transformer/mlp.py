"""The feed-forward block: GELU (GPT-2), SwiGLU (LLaMA) or GeGLU (Gemma), column- then row-parallel."""

import torch
import torch.nn.functional as F

from megand.core.sharding import retag
from megand.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megand.core.tensor_parallel.mappings import _reduce_scatter_first, copy_to_tp
from megand.core.tensor_parallel.gemm import DEFAULT, weight_grad_target, weight_grad_pass


def fuse_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The fused SwiGLU fc1 weight ``[ffn * 2, hidden]`` (row pairs: gate, up) from full gate and up
    weights ``[ffn, hidden]``."""
    return torch.stack([gate, up], dim=1).reshape(-1, *gate.shape[1:])


def split_swiglu(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_swiglu`: (gate, up), each ``[ffn, hidden]``."""
    pairs = fc1.reshape(-1, 2, *fc1.shape[1:])
    return pairs[:, 0], pairs[:, 1]


def clamped_swiglu(pairs: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's SwiGLU of an fc1 output ``[..., f, 2]`` (gate, up): the gate clamped to at most ``limit``,
    the up to ``[-limit, limit]``, ``gate * sigmoid(alpha * gate) * (up + 1)``."""
    gate, up = pairs[..., 0].clamp(max=limit), pairs[..., 1].clamp(-limit, limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


class SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` of an fc1 output ``[..., f, 2]`` (gate, up) that is already computed (the routed
    experts' grouped GEMM), saving only that input for backward and recomputing the silu there: autograd on
    the plain expression would also keep ``silu(gate)``, one more f-wide activation per layer and micro-batch."""

    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        return F.silu(h[..., 0]) * h[..., 1]

    @staticmethod
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        return _swiglu_grad(grad, h[..., 0], h[..., 1])


def _swiglu_grad(grad, gate, up):
    """The gradient of ``silu(gate) * up`` as the interleaved ``[..., f, 2]`` (gate, up) of its input. No
    kernel writes into a strided ``out=`` view: torch.compile cannot trace one."""
    # silu's own backward kernel: silu'(x) = sig(x) (1 + x (1 - sig(x))) in one pass
    return _interleave(torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate))


# the dtypes whose pairs are a complex dtype with full CPU kernels (complex64, complex128)
_COMPLEX_PAIRS = (torch.float32, torch.float64)


def _interleave(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``[..., f, 2]`` from ``first`` and ``second`` ``[..., f]``, bitwise ``torch.stack(..., dim=-1)``. Eager,
    it is written as the real and imaginary parts of a complex tensor: one vectorised pass, where the
    stack's stride-2 copies are not vectorised on CPU (4-5x slower; at llama_50m's size 3% of a step).
    Compiled, the stack, which inductor fuses into the kernel that produces the two."""
    if torch.compiler.is_compiling() or first.dtype not in _COMPLEX_PAIRS:
        return torch.stack([first, second], dim=-1)
    return torch.view_as_real(torch.complex(first, second))


class SwiGLULinear(torch.autograd.Function):
    """``silu(x W_gate^T + b_gate) * (x W_up^T + b_up)`` from the fused fc1 weight (gate and up rows
    interleaved), as two GEMMs on strided views of it. One GEMM into the interleaved ``[..., f, 2]`` output
    would leave silu and its backward on stride-2 views, which are not vectorised on CPU (several times
    slower than on the contiguous gate and up this produces).

    Saves its input, the gate and the up product (the f-wide tensors the expression needs; silu is
    recomputed in backward). Under sequence parallelism ``x`` is this rank's sequence shard: it is
    all-gathered here, only the shard is saved, and backward gathers it again and reduce-scatters the
    input gradient (as :class:`~megand.core.tensor_parallel.layers.ParallelLinear`). The products run
    through the layer's GEMM policy; backward forms the gradient of the interleaved fc1 output once, so
    its input and weight gradients are each one product against the whole fused weight (the weight
    gradient added into the engine's fp32 accumulator where it fuses)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, policy=DEFAULT):
        ctx.group, ctx.sequence_parallel, ctx.has_bias = group, sequence_parallel, bias is not None
        ctx.policy, ctx.wgrad_target = policy, weight_grad_target(weight)
        full = policy.gather_input(x, group) if sequence_parallel else policy.input_operand(x.reshape(-1, x.shape[-1]))
        gate, up = policy.forward_parts(full, weight, bias, 2)
        ctx.save_for_backward(x, weight, gate, up)
        return (F.silu(gate) * up).view(-1, *x.shape[1:-1], gate.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x, weight, gate, up = ctx.saved_tensors
        policy = ctx.policy
        grad_h = _swiglu_grad(grad.reshape(-1, grad.shape[-1]), gate, up).view(gate.shape[0], -1)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = policy.input_grad(grad_h, weight)
            if ctx.sequence_parallel:
                grad_x = _reduce_scatter_first(grad_x.view(-1, *x.shape[1:]), ctx.group)
            else:
                grad_x = grad_x.view_as(x)
        if ctx.needs_input_grad[1]:
            full = policy.regather_input(x, ctx.group) if ctx.sequence_parallel else x.reshape(-1, x.shape[-1])
            grad_weight = weight_grad_pass(policy, weight, grad_h, full, ctx.wgrad_target)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_h.sum(0)
        return grad_x, grad_weight, grad_bias, None, None, None


class SwiGLUColumnParallelLinear(ColumnParallelLinear):
    """The SwiGLU fc1: a column-parallel linear (same parameters, so the same checkpoints and hooks) whose
    output is already activated, ``silu(gate) * up`` ``[..., f / tp]``."""

    gemm_row_parts = 2  # its forward runs one GEMM per part of the interleaved rows (gate, up)

    def forward(self, x):
        if not self.sequence_parallel:
            x = copy_to_tp(x, self.tp_group)
        return SwiGLULinear.apply(x, self.weight, self.bias, self.tp_group, self.sequence_parallel, self.gemm)


class MLP(torch.nn.Module):
    """For SwiGLU and GeGLU the fused input weight is laid out ``[ffn, 2, hidden]`` (gate and up rows
    interleaved, see :func:`fuse_swiglu`), so an even split across tp gives each rank matching gate and up
    rows whatever tp is."""

    def __init__(self, cfg, topo, device=None):
        super().__init__()
        self.swiglu, self.geglu = cfg.activation == "swiglu", cfg.activation == "geglu"
        # the clamped SwiGLU's fc1 returns the gate and up products, activated here (as GeGLU)
        self.clamp = (cfg.swiglu_alpha, cfg.swiglu_limit) if cfg.swiglu_limit is not None else None
        if cfg.activation not in ("gelu", "swiglu", "geglu"):
            raise ValueError(f"model.activation={cfg.activation!r}: expected gelu, swiglu or geglu")
        common = dict(tp_group=topo.tp_group, bias=cfg.add_bias, sequence_parallel=cfg.sequence_parallel,
                      dtype=cfg.params_dtype, device=topo.device if device is None else device)
        fc1_size = cfg.ffn_hidden_size * (2 if self.swiglu or self.geglu else 1)
        fc1 = SwiGLUColumnParallelLinear if self.swiglu and self.clamp is None else ColumnParallelLinear
        self.fc1 = fc1(cfg.hidden_size, fc1_size, init_std=cfg.init_std, **common)
        if self.swiglu or self.geglu:  # rows alternate gate, up
            retag(self.fc1.weight, fused_rows=(1, 1))
        self.fc2 = RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size,
                                     init_std=cfg.init_std / (2 * cfg.num_layers) ** 0.5, **common)

    def forward(self, x):
        h = self.fc1(x)  # SwiGLU: already activated
        if self.clamp is not None:
            h = clamped_swiglu(h.unflatten(-1, (-1, 2)), *self.clamp)
        elif self.geglu:  # [..., f, 2]: gate, up
            pairs = h.unflatten(-1, (-1, 2))
            h = F.gelu(pairs[..., 0], approximate="tanh") * pairs[..., 1]
        elif not self.swiglu:
            h = F.gelu(h, approximate="tanh")
        return self.fc2(h)
