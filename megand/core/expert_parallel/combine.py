"""Combining each token's k expert outputs: ``sum_j w[t, j] * out[t, j, :]``, accumulated in fp32.

Written as autograd sees it (``out.float() * w``), the fp32 copy of every output ``[T*k, h]`` is saved
for the weights' gradient: twice the outputs' own bf16 bytes per MoE layer until backward.
:func:`weighted_sum` computes the same values and saves the outputs in their own dtype instead (the
fp32 products are rebuilt in backward, one at a time)."""

from __future__ import annotations

import torch


class _WeightedSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, outputs, weights):
        ctx.save_for_backward(outputs, weights)
        return (outputs.float() * weights.unsqueeze(-1)).sum(1).to(outputs.dtype)

    @staticmethod
    def backward(ctx, grad):
        outputs, weights = ctx.saved_tensors
        grad = grad.float().unsqueeze(1)  # [T, 1, h]
        grad_outputs = grad_weights = None
        if ctx.needs_input_grad[0]:
            grad_outputs = (grad * weights.unsqueeze(-1)).to(outputs.dtype)
        if ctx.needs_input_grad[1]:
            grad_weights = (grad * outputs.float()).sum(-1).to(weights.dtype)
        return grad_outputs, grad_weights


def weighted_sum(outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``outputs [T, k, h]`` times ``weights [T, k]`` (fp32), summed over k in fp32 -> ``[T, h]`` in the
    outputs' dtype."""
    return _WeightedSum.apply(outputs, weights)
