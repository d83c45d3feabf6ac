"""All-to-all (Ulysses) context-parallel attention: re-shard from sequence to heads, attend locally.

Each cp rank holds all heads of its (load-balanced) sequence shard. One all-to-all over the cp group
gives every rank ``heads / cp`` of the heads for the whole sequence; attention then runs on one
device with the fused kernel (SDPA), and a second all-to-all returns the output to the sequence
layout. Backward is the same two all-to-alls in reverse, so each rank moves
``4 x (cp-1)/cp`` of its q/k/v/out activations per layer, independent of the sequence length's
split, and never holds a score block larger than the kernel's own.

K/V with fewer heads than the query (GQA) are sent as they are when their head count divides by cp;
otherwise each K/V head is repeated for its query heads first (more traffic, any head count).
"""

import torch
import torch.distributed as dist

from megand.core.attention_masks import local_attention
from megand.core.context_parallel.sequence import cp_positions


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """``x [cp, ...]``: slice i goes to rank i; returns what every rank sent us, stacked by sender."""
    x = x.contiguous()  # before empty_like, which would copy a view's strides
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``[b, h, s_local, d]`` -> ``[b, h/cp, cp*s_local, d]``, sequence blocks in sender (cp rank) order."""
    cp = dist.get_world_size(group)
    b, h, s, d = x.shape
    parts = _all_to_all(x.reshape(b, cp, h // cp, s, d).transpose(0, 1), group)  # [cp (sender), b, h/cp, s, d]
    return parts.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`: ``[b, h/cp, cp*s_local, d]`` -> ``[b, h, s_local, d]``."""
    cp = dist.get_world_size(group)
    b, hl, cs, d = x.shape
    parts = _all_to_all(x.reshape(b, hl, cp, cs // cp, d).permute(2, 0, 1, 3, 4), group)  # [cp (sender), b, h/cp, s, d]
    return parts.transpose(0, 1).reshape(b, cp * hl, cs // cp, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group), None


def check_ulysses_heads(num_heads: int, tp: int, cp: int) -> None:
    """Raise ValueError unless each tensor-parallel rank's query heads split evenly over cp."""
    local = num_heads // tp
    if num_heads % tp or local % cp:
        raise ValueError(f"parallel.cp_comm=a2a needs the query heads per tensor-parallel rank "
                         f"(model.num_attention_heads={num_heads} / parallel.tp={tp} = {num_heads / tp:g}) "
                         f"to be divisible by parallel.cp={cp}")


def ulysses_attention(q, k, v, cp_group, softmax_scale=None, documents=None, window=None, sinks=None):
    """Causal attention over the whole sequence of ``cp_group``, local tokens in the load-balanced layout.

    q ``[b, nh, s_local, d]``, k/v ``[b, ng, s_local, d]`` (GQA when ng < nh); returns ``[b, nh, s_local, d]``.
    ``documents`` (a ``DocumentMask`` of the whole sequence): attention within documents, on the whole
    sequence each rank holds after the all-to-all. ``sinks [nh]``: each head's sink logit (this rank's
    ``nh / cp`` of them apply to the heads it attends).
    """
    cp = dist.get_world_size(cp_group)
    nh, ng = q.shape[1], k.shape[1]
    check_ulysses_heads(nh, 1, cp)
    if ng % cp:  # K/V heads do not split over cp: give each query head its own copy
        k, v = (t.repeat_interleave(nh // ng, dim=1) for t in (k, v))
    seq = q.shape[2] * cp
    # gathered blocks arrive in cp-rank order, each holding that rank's two load-balanced chunks
    order = torch.cat([cp_positions(seq, r, cp, device=q.device) for r in range(cp)])
    natural = torch.argsort(order)
    q, k, v = (_SeqToHeads.apply(t, cp_group).index_select(2, natural) for t in (q, k, v))
    if sinks is not None:  # the heads rank r attends after the all-to-all: [r, r + 1) * nh / cp
        sinks = sinks.view(cp, -1)[dist.get_rank(cp_group)]
    if documents is not None:
        out = documents.attend(q, k, v, scale=softmax_scale, window=window, sinks=sinks)
    else:
        out = local_attention(q, k, v, window, scale=softmax_scale, sinks=sinks)
    return _HeadsToSeq.apply(out.index_select(2, order), cp_group)
