"""Attention sinks (GPT-OSS): one learned logit per head in every query's softmax denominator, with no value.

Every attention path computes its output ``out`` with each query row's log-sum-exp ``lse`` (one block here;
context parallelism's blocks merged by their log-sum-exp), so the sinks are one finishing step after the whole
attention (:func:`finish`): ``lse_f = logaddexp(lse, sink_h)``, ``out_f = out * exp(lse - lse_f)``. The pair
``(out_f, lse_f)`` is what a flash-style backward takes: from it and ``dout_f`` the blocks' backward (the explicit
math or a flash kernel, which forms ``delta = rowsum(dout_f * out_f)`` itself) gives the exact gradients of q, k
and v, and the sink's is ``-sum exp(sink_h - lse_f) * delta`` over the head's rows (:func:`sinks_grad`). The sinks
are per head: split over tensor-parallel ranks with the heads, their gradient partial over the cp ranks' rows.
"""

from __future__ import annotations

import torch


def finish(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor):
    """``(out_f, lse_f)``: ``out [b, h, s, d]`` and its rows' ``lse [b, h, s]`` with the ``sinks [h]`` in the
    softmax denominator, in ``lse``'s (fp32 or fp64) precision."""
    lse_f = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])
    return out.to(lse.dtype) * torch.exp(lse - lse_f).unsqueeze(-1), lse_f


def sinks_grad(delta: torch.Tensor, lse_f: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The sinks' gradient from ``delta = rowsum(dout_f * out_f)`` and the finished ``lse_f`` ``[b, h, s]``."""
    return -(torch.exp(sinks.to(lse_f.dtype)[None, :, None] - lse_f) * delta).sum((0, 2)).to(sinks.dtype)


class _Fp64Blocks:
    """The blocks' explicit math in fp64 (a reference computation keeps its precision; the CP blocks are fp32)."""

    @staticmethod
    def prepare(t):
        return t

    @staticmethod
    def forward(q, k, v, scale, causal, allowed=None):
        from megand.core.context_parallel.block_kernels import block_forward

        return block_forward(q, k, v, scale, causal, allowed)

    @staticmethod
    def backward(dout, q, k, v, out, lse, delta, scale, causal, allowed=None):
        from megand.core.context_parallel.block_kernels import block_backward

        return block_backward(dout, q, k, v, lse, delta, scale, causal, allowed)


def _blocks_for(q):
    from megand.core.context_parallel.block_kernels import blocks_for  # its package imports the masks, which import us

    return _Fp64Blocks if q.dtype == torch.float64 else blocks_for(q)


class _SinkAttention(torch.autograd.Function):
    """Attention of q over all of k/v in one block (:mod:`megand.core.context_parallel.block_kernels`: the flash
    kernel on CUDA in bf16/fp16 without a mask, the explicit math otherwise), finished by the sinks."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, scale, allowed):
        blocks = _blocks_for(q)
        out, lse = finish(*blocks.forward(blocks.prepare(q), blocks.prepare(k), blocks.prepare(v), scale,
                                          allowed is None, allowed), sinks)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.scale, ctx.allowed = scale, allowed
        return out.to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        delta = (dout.to(out.dtype) * out).sum(-1)
        blocks = _blocks_for(q)
        dq, dk, dv = blocks.backward(blocks.prepare(dout), blocks.prepare(q), blocks.prepare(k), blocks.prepare(v),
                                     out, lse, delta, ctx.scale, ctx.allowed is None, ctx.allowed)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), sinks_grad(delta, lse, sinks), None, None


def sink_attention(q, k, v, sinks, scale=None, allowed=None):
    """Attention of ``q [b, h, sq, d]`` over ``k, v [b, g, sk, d]`` (h % g == 0) with each head's sink logit
    ``sinks [h]`` in the denominator: causal with the last query at the last key, or where ``allowed``
    ``[b or 1, sq, sk]`` says (every row must see a key)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _SinkAttention.apply(q, k, v, sinks, scale, allowed)
