"""Attention sinks over context parallelism, per tensor: ring, all-gather and all-to-all (Ulysses) attention with
the sinks (and a sliding window) equal, on 2 cp ranks, transformers' eager form on the whole sequence (the sink
logit appended to each row's scores and dropped after the softmax): the output, dq, dk, dv and the sinks'
gradient summed over the cp ranks."""

import torch
import torch.distributed as dist

from megand.core.attention_masks import visible
from megand.core.context_parallel import all_gather_attention, ring_attention, split_for_cp, ulysses_attention
from megand.tools.spawn import run_distributed

ATTENTIONS = {"ring": ring_attention, "all_gather": all_gather_attention, "a2a": ulysses_attention}
SEQ, HEADS, GROUPS, D = 32, 4, 2, 8


def _reference(q, k, v, sinks, window):
    k, v = (t.repeat_interleave(HEADS // GROUPS, dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * D ** -0.5
    scores = scores.masked_fill(~visible(torch.arange(SEQ), torch.arange(SEQ), window), float("-inf"))
    logits = torch.cat([scores, sinks[None, :, None, None].expand(*scores.shape[:3], 1)], dim=-1)
    return torch.softmax(logits, dim=-1)[..., :-1] @ v


def _worker():
    group = dist.group.WORLD
    rank, size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    q, dout = (torch.randn(2, HEADS, SEQ, D, generator=g) for _ in range(2))
    k, v = (torch.randn(2, GROUPS, SEQ, D, generator=g) for _ in range(2))
    sinks = torch.randn(HEADS, generator=g)
    local = lambda t: split_for_cp(t, 2, rank, size)  # noqa: E731
    out = {}
    for window in (None, 8):
        ref = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        _reference(*ref, window).backward(dout)
        for name, attention in ATTENTIONS.items():
            mine = [local(t).clone().requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
            o = attention(*mine[:3], group, window=window, sinks=mine[3])
            o.backward(local(dout))
            dsinks = mine[3].grad.clone()
            dist.all_reduce(dsinks, group=group)  # each rank's rows: summed over cp (the gradient reduction's)
            with torch.no_grad():
                ref_out = _reference(*[t.detach() for t in ref], window)
            out[(name, window)] = max((o - local(ref_out)).abs().max().item(),
                                      *((m.grad - local(r.grad)).abs().max().item() for m, r in zip(mine[:3], ref)),
                                      (dsinks - ref[3].grad).abs().max().item())
    return out


def test_cp_sinks_equal_the_whole_sequence():
    for rank, result in enumerate(run_distributed(_worker, 2)):
        for case, diff in result.items():
            assert diff <= 1e-5, (rank, case, diff)
