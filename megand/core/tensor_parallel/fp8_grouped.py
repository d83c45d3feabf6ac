"""The routed experts' products under an FP8 recipe: each expert's operands are quantised on their own (the
rows of expert ``e``, ``offsets[e-1]:offsets[e]``, and its weight ``W_e [n, k]``), with the scales a
grouped scaled GEMM takes, the same on every device; the products run in torch's grouped kernels on CUDA
where the device has them (:class:`~megand.core.tensor_parallel.fp8.Fp8Kernels`) and are emulated
elsewhere (the dequantised operands multiplied per expert in fp32).

Scales (``x [M, k]`` the tokens grouped by expert, ``dy [M, n]`` their output gradient, ``W [E, n, k]``):

==============  =====================================  =====================================
product         rowwise                                tensorwise
==============  =====================================  =====================================
forward         x per row, W_e per row (along k)       x_e and W_e one scale each
input gradient  dy per row, W_e per column (along n)   dy_e one scale, W_e as in forward
weight grad     dy_e, x_e per column (along tokens)    dy_e, x_e one scale each
==============  =====================================  =====================================

A tensorwise scale per expert is a rowwise scale whose rows share their expert's value, which is how it
reaches the kernel (``torch._scaled_grouped_mm`` takes per-row fp32 scales only). The output gradient is
e4m3, not e5m2 as in the dense layers: the grouped kernel takes e4m3 operands only, and the per-row or
per-expert scales give it the range. Scales agree over the tensor-parallel group where the layer's split
makes a shard's scale differ from the whole's (as in :class:`~megand.core.tensor_parallel.fp8.Fp8Policy`).

Kernels (CUDA, SM 9.0 / 10.x): forward and input gradient in ``torch._scaled_grouped_mm`` (row-major
FP8 tokens, the weights column-major, every dim of the weights a multiple of 16, a bf16 result); the
weight gradient in the bf16 grouped GEMM on the FP8 values (exact in bf16), its fp32-accumulated sums
scaled afterwards: the FP8 grouped kernel's weight-gradient form needs every expert's token count a
positive multiple of 16 (a device-side assert otherwise), which routing does not give. Rows of no expert
(dropped assignments, after the last expert's) come out as zeros. MXFP8 experts run per expert through
the dense recipe (:func:`expert_loop`): the grouped MX kernel needs token counts that are multiples of 32.
"""

from __future__ import annotations

import torch

from megand.core.host_reads import even_offsets, host_list
from megand.core.tensor_parallel.fp8_recipes.scaling import _TINY, E4M3, _agreed_max, fmax
from megand.core.tensor_parallel.wgrad import add_product, hand_over


def expert_row_splits(x: torch.Tensor, offsets, experts: int) -> list[torch.Tensor]:
    """The rows of each expert (then the rows of no expert), split at ``offsets`` read on the host
    (:func:`~megand.core.host_reads.host_list`: an even split where they hold no values)."""
    return list(torch.tensor_split(x, host_list(offsets, lambda: even_offsets(x.shape[0], experts))))


class GroupedOperands:
    """The grouping of ``rows`` token rows: ``group[r]`` the expert of row ``r`` (``experts`` for rows of
    no expert), and the kernels' offsets (the rows of no expert ride with the last expert: the kernel
    covers every row, their outputs are zeroed)."""

    def __init__(self, offsets: torch.Tensor, rows: int, experts: int):
        self.offsets, self.rows, self.experts = offsets, rows, experts
        positions = torch.arange(rows, device=offsets.device, dtype=offsets.dtype)
        self.group = torch.searchsorted(offsets, positions, right=True)
        self.valid = self.group < experts
        self.kernel_offsets = torch.cat([offsets[:-1], offsets.new_full((1,), rows)])

    def amax(self, t: torch.Tensor, per_column: bool) -> torch.Tensor:
        """The amax of each expert's rows of ``t [M, c]`` (then of the rows of no expert): ``[E + 1, c]``
        per column, else ``[E + 1]``."""
        values = t.float().abs()
        if not per_column:
            values = values.amax(dim=1)
        index = self.group.view(-1, *([1] * (values.dim() - 1))).expand_as(values)
        out = values.new_zeros((self.experts + 1,) + tuple(values.shape[1:]))
        return out.scatter_reduce(0, index, values, "amax")


def _scale(amax, group, agree: bool) -> torch.Tensor:
    return _agreed_max(amax, group if agree else None).clamp(min=_TINY) / fmax(E4M3)


def _cast(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (t.float() / scale).clamp(-fmax(E4M3), fmax(E4M3)).to(E4M3)


class GroupedFp8:
    """One grouped layer's FP8 products under ``policy`` (its recipe, tp split and device kernels)."""

    def __init__(self, policy, offsets: torch.Tensor, rows: int, experts: int):
        self.policy, self.kernels = policy, policy.kernels
        self.per_row = policy.recipe.per_row  # else one scale per expert's operand
        self.groups = GroupedOperands(offsets, rows, experts)

    def _agree(self, dims: str, contraction: str | None) -> bool:
        """The dense recipe's rule (its record's ``agrees``): one scale agrees over tp when a dim of the
        operand is split, a row's when the contraction axis is (None: along the tokens, never split)."""
        return self.policy.recipe.agrees(self.policy.sharded, dims, contraction)

    # -- quantised operands -------------------------------------------------------------------------
    def tokens(self, t: torch.Tensor, dims: str, contraction: str):
        """Token rows ``t [M, c]`` scaled along ``c``: FP8 values and the scale of each row ``[M]``."""
        g = self.groups
        if self.per_row:
            row_scale = _scale(t.float().abs().amax(dim=1), self.policy.group, self._agree(dims, contraction))
        else:
            row_scale = _scale(g.amax(t, per_column=False), self.policy.group, self._agree(dims, contraction))[g.group]
        return _cast(t, row_scale[:, None]), row_scale

    def tokens_by_column(self, t: torch.Tensor, dims: str):
        """Token rows ``t [M, c]`` scaled along the tokens of each expert (the weight gradient's operands):
        FP8 values and the scales ``[E + 1, c]`` (rowwise) or ``[E + 1, 1]``."""
        g = self.groups
        amax = g.amax(t, per_column=self.per_row)
        scale = _scale(amax, self.policy.group, self._agree(dims, None))
        scale = scale if scale.dim() == 2 else scale[:, None]
        return _cast(t, scale[g.group]), scale

    def weight(self, weight: torch.Tensor, along: str):
        """``W [E, n, k]`` scaled along ``k`` (forward) or ``n`` (input gradient): FP8 values and scales
        ``[E, n, 1]`` / ``[E, 1, k]`` (rowwise) or ``[E, 1, 1]``."""
        w = weight.float().abs()
        if self.per_row:
            amax = w.amax(dim=2 if along == "k" else 1, keepdim=True)
        else:
            amax = w.amax(dim=(1, 2), keepdim=True)
        scale = _scale(amax, self.policy.group, self._agree("nk", along))
        return _cast(weight, scale), scale

    # -- products ---------------------------------------------------------------------------------
    def _grouped_kernel_takes(self, a: torch.Tensor, b: torch.Tensor, out_dtype) -> bool:
        return (self.kernels.grouped and a.is_cuda and out_dtype == torch.bfloat16
                and a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0 and b.shape[2] % 16 == 0)

    def _token_product(self, qa, row_scale, qb, b_scale, out_dtype) -> torch.Tensor:
        """``a_e @ b_e^T`` for the rows of each expert: ``qa [M, c]`` (scales ``[M]``), ``qb [E, d, c]``
        (scales broadcastable to ``[E, d, 1]``) -> ``[M, d]``, rows of no expert zero."""
        g = self.groups
        if self._grouped_kernel_takes(qa, qb, out_dtype):
            column_major = qb.transpose(-2, -1)  # [E, c, d] with unit stride along c
            scale_b = b_scale.expand(qb.shape[0], qb.shape[1], 1).reshape(qb.shape[0], qb.shape[1]).contiguous()
            out = torch._scaled_grouped_mm(qa, column_major, row_scale.contiguous(), scale_b,
                                           offs=g.kernel_offsets, out_dtype=out_dtype)
            return torch.where(g.valid[:, None], out, out.new_zeros(()))
        a = qa.float() * row_scale[:, None]
        b = qb.float() * b_scale
        parts = expert_row_splits(a, g.offsets, g.experts)
        outs = [parts[e] @ b[e].t() for e in range(g.experts)]
        outs.append(a.new_zeros(parts[-1].shape[0], b.shape[1]))
        return torch.cat(outs).to(out_dtype)

    def forward(self, x, weight):
        qx, sx = self.tokens(x, "mk", "k")
        qw, sw = self.weight(weight, "k")
        return self._token_product(qx, sx, qw.contiguous(), sw, weight.dtype)

    def input_grad(self, grad, weight):
        qg, sg = self.tokens(grad, "mn", "n")
        qw, sw = self.weight(weight, "n")
        # the kernel's operand b_e [k, n] column-major: W_e^T stored [E, k, n] row-major
        return self._token_product(qg, sg, qw.transpose(-2, -1).contiguous(), sw.transpose(-2, -1), grad.dtype)

    def weight_grad(self, grad, x) -> torch.Tensor:
        """``dy_e^T x_e`` ``[E, n, k]`` in fp32: the sums of products of the FP8 values, then scaled."""
        g = self.groups
        qg, sg = self.tokens_by_column(grad, "mn")
        qx, sx = self.tokens_by_column(x, "mk")
        sums = weight_sums(qg, qx, g, kernel=self.kernels.grouped and x.is_cuda)
        return sums * sg[:g.experts, :, None] * sx[:g.experts, None, :]


def weight_sums(qg: torch.Tensor, qx: torch.Tensor, groups: GroupedOperands, kernel: bool) -> torch.Tensor:
    """``sum_t qg[t, :]^T qx[t, :]`` over each expert's rows ``[E, n, k]`` in fp32. ``kernel``: torch's bf16
    grouped GEMM (FP8 values are exact in bf16; fp32 sums rounded once to bf16), in the layout that takes any
    token count (``qg^T`` column-major, ``qx`` row-major); else per expert in fp32."""
    if kernel:  # the rows of no expert ride with the last expert: their values are left out
        a = qg.to(torch.bfloat16).masked_fill(~groups.valid[:, None], 0)
        return torch._grouped_mm(a.t(), qx.to(torch.bfloat16), offs=groups.kernel_offsets).float()
    gs = expert_row_splits(qg.float(), groups.offsets, groups.experts)
    xs = expert_row_splits(qx.float(), groups.offsets, groups.experts)
    return torch.stack([gs[e].t() @ xs[e] for e in range(groups.experts)])


class ExpertLoop:
    """MXFP8 experts: each expert's products through the dense recipe (blocks of 32 along each expert's own
    rows), the rows split on the host."""

    def __init__(self, policy, offsets, rows, experts):
        self.policy, self.offsets, self.experts = policy, offsets, experts
        self.groups = GroupedOperands(offsets, rows, experts)

    def _split(self, t):
        return expert_row_splits(t, self.offsets, self.experts)

    def forward(self, x, weight):
        parts = self._split(x)
        outs = [self.policy.forward(parts[e], weight[e]) for e in range(self.experts)]
        return torch.cat(outs + [x.new_zeros(parts[-1].shape[0], weight.shape[1])])

    def input_grad(self, grad, weight):
        parts = self._split(grad)
        outs = [self.policy.input_grad(parts[e], weight[e]) for e in range(self.experts)]
        return torch.cat(outs + [grad.new_zeros(parts[-1].shape[0], weight.shape[2])])

    def weight_grad(self, grad, x):
        gs, xs = self._split(grad), self._split(x)
        return torch.stack([self.policy._weight_product(gs[e], xs[e], torch.float32) for e in range(self.experts)])


def grouped_products(policy, offsets, rows, experts):
    return (GroupedFp8 if policy.recipe.grouped_experts else ExpertLoop)(policy, offsets, rows, experts)


class GroupedFp8Linear(torch.autograd.Function):
    """The routed experts' ``x_e W_e^T (+ b_e)`` in FP8 (see the module docstring); rows of no expert come
    out as zeros. The weight gradient goes through the GEMM seam like a dense layer's: added into the
    engine's fp32 accumulator (``target``), now or, inside a
    :class:`~megand.core.tensor_parallel.wgrad.DeferredWeightGrads`, in a zero-bubble schedule's W pass;
    returned to autograd where ``target`` is None."""

    @staticmethod
    def forward(ctx, x, weight, bias, offsets, policy, target):
        products = grouped_products(policy, offsets, x.shape[0], weight.shape[0])
        ctx.products, ctx.target, ctx.has_bias = products, target, bias is not None
        ctx.save_for_backward(x, weight)
        out = products.forward(x, weight)
        if bias is not None:  # rows of no expert: no bias
            out = out + torch.cat([bias, bias.new_zeros(1, bias.shape[1])])[products.groups.group]
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        products = ctx.products
        grad = grad.contiguous()
        grad_x = products.input_grad(grad, weight)
        grad_weight = grad_bias = None
        if ctx.target is None:
            grad_weight = products.weight_grad(grad, x).to(weight.dtype)
        else:
            hand_over(ctx.target, lambda main, overwrite: add_product(main, products.weight_grad(grad, x), overwrite))
        if ctx.has_bias:
            experts = weight.shape[0]
            sums = grad.new_zeros(experts + 1, grad.shape[1], dtype=torch.float32)
            grad_bias = sums.index_add_(0, products.groups.group, grad.float())[:experts].to(grad.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None
