"""Attention sinks (GPT-OSS) as a finishing step on (out, log-sum-exp): equal in fp64, forward and every
gradient (the sinks' included), to the softmax with the sink logit appended as a column and dropped after it
(transformers' eager form), on each local path: causal, a sliding window, grouped K/V, queries that are a
suffix of the keys (the generation cache) and documents."""

import pytest
import torch

from megand.core.attention_masks import local_attention, visible
from megand.core.transformer.documents import DocumentMask
from megand.core.transformer.kv_cache import cached_attention


def reference(q, k, v, sinks, allowed):
    """transformers' eager attention with sinks: ``allowed [b or 1, sq, sk]``."""
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    logits = torch.cat([scores, sinks[None, :, None, None].expand(*scores.shape[:3], 1)], dim=-1)
    return torch.softmax(logits, dim=-1)[..., :-1] @ v


def tensors(sq=12, sk=12, heads=4, groups=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    return make(2, heads, sq, d), make(2, groups, sk, d), make(2, groups, sk, d), make(heads)


def grads(out, inputs):
    return torch.autograd.grad((out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum(), inputs)


@pytest.mark.parametrize("case", ["causal", "window", "suffix", "suffix_window", "documents", "cache_one"])
def test_sinks_equal_the_appended_column_softmax(case):
    sq = {"suffix": 5, "suffix_window": 5, "cache_one": 1}.get(case, 12)
    q, k, v, sinks = tensors(sq=sq)
    window = 4 if "window" in case else None
    allowed = visible(torch.arange(12 - sq, 12), torch.arange(12), window)[None]
    if case == "documents":
        ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3])
        ours = DocumentMask(ids).attend(q, k, v, sinks=sinks)
        allowed = allowed & (ids[:, :, None] == ids[:, None, :])
    elif case == "cache_one":
        ours = cached_attention(q, k, v, sinks=sinks)
    else:
        ours = local_attention(q, k, v, window, sinks=sinks)
    theirs = reference(q, k, v, sinks, allowed)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads(ours, (q, k, v, sinks)), grads(theirs, (q, k, v, sinks))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_sinks_on_a_flash_kernel_equal_the_appended_column_softmax(monkeypatch):
    """The fused blocks (CPU's flash kernel, the contract of CUDA's: its backward forms rowsum(dout * out) itself)
    take the finished output and log-sum-exp: forward and gradients equal the reference (fp32)."""
    from megand.core.context_parallel import block_kernels

    monkeypatch.setattr(block_kernels, "blocks_for", lambda q: block_kernels.FusedBlocks(block_kernels.CPU_FLASH))
    q, k, v, sinks = (t.detach().float().requires_grad_() for t in tensors())
    ours = local_attention(q, k, v, sinks=sinks)
    theirs = reference(q, k, v, sinks, visible(torch.arange(12), torch.arange(12))[None])
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads(ours, (q, k, v, sinks)), grads(theirs, (q, k, v, sinks))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
