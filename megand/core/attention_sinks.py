"""Attention sinks (GPT-OSS): one learned logit per head in every query's softmax denominator, with no value.

Every attention path computes its output ``out`` with each query row's log-sum-exp ``lse`` (one block here;
context parallelism's blocks merged by their log-sum-exp), so the sink is one finishing step after the whole
attention: ``lse_f = logaddexp(lse, sink_h)``, ``out_f = out * exp(lse - lse_f)``. Autograd takes the
gradient through that step, to the sink and to ``lse``; the attention's own backward takes ``lse``'s
gradient as ``delta - dlse`` (``d lse / d score`` is the probability, so it enters where ``delta =
rowsum(dout * out)`` does). The sinks are per head: split over tensor-parallel ranks with the heads.
"""

from __future__ import annotations

import torch


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``out [b, h, s, d]`` with each row's ``lse [b, h, s]`` (fp32) rescaled by the softmax mass the sinks
    ``[h]`` take: the attention with the sinks in its denominator, in ``out``'s dtype."""
    wide = torch.promote_types(lse.dtype, torch.float32)
    lse_f = torch.logaddexp(lse, sinks.to(wide)[None, :, None])
    return (out.to(wide) * torch.exp(lse - lse_f).unsqueeze(-1)).to(out.dtype)


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


class _BlockAttention(torch.autograd.Function):
    """``(out, lse)`` of q over all of k/v in one block (:mod:`megand.core.context_parallel.block_kernels`:
    the flash kernel on CUDA in bf16/fp16 without a mask, the explicit fp32 math otherwise); ``lse`` is
    differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, scale, allowed):
        blocks = _blocks_for(q)
        out, lse = blocks.forward(blocks.prepare(q), blocks.prepare(k), blocks.prepare(v), scale, allowed is None,
                                  allowed)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.allowed = scale, allowed
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(q)
        delta = (dout.to(out.dtype) * out).sum(-1)
        if dlse is not None:
            delta = delta - dlse
        blocks = _blocks_for(q)
        dq, dk, dv = blocks.backward(blocks.prepare(dout), blocks.prepare(q), blocks.prepare(k), blocks.prepare(v),
                                     out, lse, delta, ctx.scale, ctx.allowed is None, ctx.allowed)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def attention_lse(q, k, v, scale=None, allowed=None):
    """``(out [b, h, sq, d], lse [b, h, sq] fp32)`` of q over k/v ``[b, g, sk, d]`` (h % g == 0): causal with the
    last query at the last key, or where ``allowed`` ``[b or 1, sq, sk]`` says (every row must see a key)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _BlockAttention.apply(q, k, v, scale, allowed)


def sink_attention(q, k, v, sinks, scale=None, allowed=None):
    """:func:`attention_lse` finished by the ``sinks [h]``."""
    return with_sinks(*attention_lse(q, k, v, scale, allowed), sinks)
