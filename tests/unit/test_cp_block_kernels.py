"""The fused context-parallel block kernel (flash attention returning the log-sum-exp, backward from the
final output and log-sum-exp) against the explicit fp32 math, run on CPU's flash kernel, which has the
same contract as CUDA's; and the choice of kernel from the tensors' device and dtype."""

from types import SimpleNamespace

import pytest
import torch

from megand.core.context_parallel.block_kernels import (CPU_FLASH, ExplicitBlocks, FusedBlocks, blocks_for,
                                                        flash_supported)

B, D = 2, 16


def _tensors(nh, ng, sq, sk, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, nh, sq, D, generator=gen).to(dtype)
    k, v = (torch.randn(B, ng, sk, D, generator=gen).to(dtype) for _ in range(2))
    return q, k, v


def _merge(a, b):
    """Two blocks' (out, lse) over the same queries, merged by the log-sum-exp rule."""
    lse = torch.logaddexp(a[1], b[1])
    return a[0] * torch.exp(a[1] - lse)[..., None] + b[0] * torch.exp(b[1] - lse)[..., None], lse


@pytest.mark.parametrize("nh,ng", [(4, 4), (4, 2)])  # MHA and GQA
@pytest.mark.parametrize("sq,sk,causal", [(8, 8, True), (8, 16, True), (8, 24, True), (8, 16, False)])
def test_forward_matches_explicit_math(nh, ng, sq, sk, causal):
    q, k, v = _tensors(nh, ng, sq, sk)
    fused, explicit = FusedBlocks(CPU_FLASH), ExplicitBlocks()
    out, lse = fused.forward(q, k, v, 0.3, causal)
    ref_out, ref_lse = explicit.forward(q, k, v, 0.3, causal)
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("nh,ng", [(4, 4), (4, 2)])
def test_backward_from_the_final_lse_matches_explicit_math(nh, ng):
    """Two blocks (a causal own block with more keys than queries, and a fully visible earlier block), merged;
    each block's gradients from the merged output and lse, as the ring computes them."""
    q, k_own, v_own = _tensors(nh, ng, 8, 16, seed=1)
    _, k_far, v_far = _tensors(nh, ng, 8, 8, seed=2)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    explicit, fused = ExplicitBlocks(), FusedBlocks(CPU_FLASH)
    out, lse = _merge(explicit.forward(q, k_own, v_own, 0.25, True), explicit.forward(q, k_far, v_far, 0.25, False))
    delta = (dout * out).sum(-1)
    for k, v, causal in ((k_own, v_own, True), (k_far, v_far, False)):
        mine = fused.backward(dout, q, k, v, out, lse, delta, 0.25, causal)
        ref = explicit.backward(dout, q, k, v, out, lse, delta, 0.25, causal)
        for name, a, b in zip(("dq", "dk", "dv"), mine, ref):
            assert a.shape == b.shape and a.dtype == torch.float32, name
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_the_explicit_blocks_equal_autograd_of_full_attention():
    """The reference itself: a causal block with more keys than queries against autograd of masked softmax."""
    q, k, v = _tensors(4, 2, 8, 16)
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = q @ kk.transpose(-1, -2) * 0.3
    scores = scores.masked_fill(torch.ones(8, 16, dtype=torch.bool).triu(16 - 8 + 1), float("-inf"))
    expected = torch.softmax(scores, -1) @ vv
    dout = torch.randn(expected.shape, dtype=torch.double)
    expected.backward(dout)
    out, lse = ExplicitBlocks.forward(q.detach(), k.detach(), v.detach(), 0.3, True)
    torch.testing.assert_close(out.double(), expected.detach(), rtol=1e-5, atol=1e-5)
    delta = (dout.float() * out).sum(-1)
    grads = ExplicitBlocks.backward(dout.float(), q.detach(), k.detach(), v.detach(), out, lse, delta, 0.3, True)
    for a, b in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


def test_document_masked_blocks_use_the_explicit_math():
    q, k, v = _tensors(4, 2, 8, 8)
    ids = torch.tensor([[0] * 3 + [1] * 5, [0] * 8])
    allowed = (ids[:, :, None] == ids[:, None, :]) & torch.ones(8, 8, dtype=torch.bool).tril()
    out, lse = FusedBlocks(CPU_FLASH).forward(q, k, v, 0.3, False, allowed)
    ref_out, ref_lse = ExplicitBlocks.forward(q, k, v, 0.3, False, allowed)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_bf16_blocks_run_in_bf16_and_merge_in_fp32():
    q, k, v = _tensors(4, 2, 8, 16, dtype=torch.bfloat16)
    out, lse = FusedBlocks(CPU_FLASH).forward(q, k, v, 0.3, True)
    ref_out, ref_lse = ExplicitBlocks.forward(q, k, v, 0.3, True)  # the same bf16 inputs, in fp32 math
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=2e-2)  # bf16 products: 8 bits of mantissa
    torch.testing.assert_close(lse, ref_lse, rtol=2e-2, atol=2e-2)


def test_kernel_choice_from_device_and_dtype():
    def fake(device, dtype, d=64):
        return SimpleNamespace(device=torch.device(device), dtype=dtype, shape=(1, 4, 8, d))

    assert flash_supported(fake("cuda", torch.bfloat16)) and flash_supported(fake("cuda", torch.float16))
    assert not flash_supported(fake("cuda", torch.float32))  # flash kernels take no fp32
    assert not flash_supported(fake("cuda", torch.bfloat16, d=260))  # head dim above 256
    assert not flash_supported(fake("cuda", torch.bfloat16, d=60))  # head dim not a multiple of 8
    assert not flash_supported(fake("cpu", torch.bfloat16))  # CPU keeps the explicit math
    assert isinstance(blocks_for(torch.zeros(1, 4, 8, 64, dtype=torch.bfloat16)), ExplicitBlocks)
    assert isinstance(blocks_for(torch.zeros(1, 4, 8, 64)), ExplicitBlocks)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's flash kernel (run by make gpu-check)")
@pytest.mark.parametrize("sq,sk,causal", [(128, 128, True), (128, 256, True), (128, 128, False)])
def test_cuda_flash_blocks_match_explicit_math(sq, sk, causal):
    from megand.core.context_parallel.block_kernels import CUDA_FLASH

    q, k, v = (t.cuda() for t in _tensors(8, 2, sq, sk, dtype=torch.bfloat16))
    assert isinstance(blocks_for(q), FusedBlocks)
    dout = torch.randn(q.shape, device="cuda").bfloat16()
    fused, explicit = FusedBlocks(CUDA_FLASH), ExplicitBlocks()
    out, lse = explicit.forward(q, k, v, 0.25, causal)
    delta = (dout.float() * out).sum(-1)
    mine = (*fused.forward(q, k, v, 0.25, causal), *fused.backward(dout, q, k, v, out, lse, delta, 0.25, causal))
    ref = (out, lse, *explicit.backward(dout, q, k, v, out, lse, delta, 0.25, causal))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), mine, ref):
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2, msg=name)  # bf16 inputs and outputs
