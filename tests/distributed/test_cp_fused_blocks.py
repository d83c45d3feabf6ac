"""Ring and all-gather attention with their blocks on a fused flash kernel (CPU's, which has the contract of
CUDA's: forward returns the log-sum-exp, backward takes the final output and log-sum-exp) against
single-process causal SDPA. CPU runs use the explicit math; here the test process swaps the kernel in."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megand.core.context_parallel import all_gather_attention, ring_attention, split_for_cp
from megand.tools.spawn import run_distributed

SEQ, HEAD_DIM = 64, 16


def _worker():
    import sys

    from megand.core.context_parallel.block_kernels import CPU_FLASH, FusedBlocks

    chosen = []

    def fused(q):
        chosen.append(q.dtype)
        return FusedBlocks(CPU_FLASH)

    # the module (the package exports a function of the same name)
    sys.modules["megand.core.context_parallel.ring_attention"].blocks_for = fused
    rank, size = dist.get_rank(), dist.get_world_size()
    diffs = {}
    for name, attention in (("ring", ring_attention), ("all_gather", all_gather_attention)):
        for nh, ng, scale in ((4, 2, 0.3), (4, 4, None)):
            gen = torch.Generator().manual_seed(1234)
            q, dout = (torch.randn(2, nh, SEQ, HEAD_DIM, generator=gen) for _ in range(2))
            k, v = (torch.randn(2, ng, SEQ, HEAD_DIM, generator=gen) for _ in range(2))
            ref = [t.clone().requires_grad_() for t in (q, k, v)]
            ref_out = F.scaled_dot_product_attention(ref[0], ref[1].repeat_interleave(nh // ng, 1),
                                                     ref[2].repeat_interleave(nh // ng, 1), is_causal=True, scale=scale)
            ref_out.backward(dout)
            local = [split_for_cp(t, 2, rank, size).requires_grad_() for t in (q, k, v)]
            out = attention(*local, dist.group.WORLD, softmax_scale=scale)
            out.backward(split_for_cp(dout, 2, rank, size))
            pairs = zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in local)),
                        (ref_out, *(t.grad for t in ref)))
            diffs[(name, nh, ng)] = {n: (a - split_for_cp(b, 2, rank, size)).abs().max().item() for n, a, b in pairs}
    return diffs, len(chosen)


@pytest.mark.parametrize("world", [2])
def test_fused_blocks_match_sdpa(world):
    for rank, (diffs, calls) in enumerate(run_distributed(_worker, world)):
        assert calls == 8  # forward and backward of 2 variants x 2 head layouts: the swapped kernel ran
        for case, d in diffs.items():
            assert max(d.values()) <= 1e-5, (rank, case, d)
