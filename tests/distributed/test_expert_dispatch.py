"""The all-to-all dispatcher against a one-process computation of the same routing: outputs, input
gradients, per-expert weight gradients and the bytes exchanged (spawned gloo ranks)."""

import pytest
import torch

from megand.tools.spawn import run_distributed

E, H, K, T = 8, 6, 2, 10  # experts, hidden, top-k, tokens per rank


def _inputs(rank):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g)
    experts = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g)
    keep = torch.rand(T, K, generator=g) > 0.3
    experts[0] = torch.tensor([0, 1])  # a skewed load: many to expert 0, nothing to the last expert
    experts[1:4, 0] = 0
    experts[experts == E - 1] = E - 2
    return x, experts, weights, keep


def _expert_weights():
    return torch.randn(E, H, H, generator=torch.Generator().manual_seed(7))


def _reference(x, experts, weights, keep, w):
    """Plain loops: token t's output is sum_j keep * weight_j * (x_t @ w[e_j].T)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(K):
            if keep is None or keep[t, j]:
                out[t] += weights[t, j] * (x[t] @ w[experts[t, j]].t())
    return out


def _worker(use_keep):
    import torch.distributed as dist

    from megand.core.expert_parallel import AllToAllDispatcher

    rank, world = dist.get_rank(), dist.get_world_size()
    full_w = _expert_weights()
    local = E // world
    w = full_w[rank * local:(rank + 1) * local].clone().requires_grad_(True)
    x, experts, weights, keep = _inputs(rank)
    keep = keep if use_keep else None
    x.requires_grad_(True)
    disp = AllToAllDispatcher(E, dist.group.WORLD, world, rank)
    tokens, counts, offsets, state = disp.permute(x, experts, keep)
    parts = torch.tensor_split(tokens, offsets.tolist()[:-1])
    assert len(parts) == local and counts.tolist() == [p.shape[0] for p in parts]
    y = torch.cat([p @ w[j].t() for j, p in enumerate(parts)])
    out = disp.unpermute(y, state, weights, keep)
    out.pow(2).sum().backward()
    return out.detach(), x.grad, w.grad, disp.bytes_sent, state.send, state.recv


def _check(world, use_keep):
    results = run_distributed(_worker, world, use_keep)
    full_w = _expert_weights().requires_grad_(True)
    total = 0
    for rank in range(world):
        x, experts, weights, keep = _inputs(rank)
        keep = keep if use_keep else None
        x.requires_grad_(True)
        ref = _reference(x, experts, weights, keep, full_w)
        ref.pow(2).sum().backward()
        out, xgrad, _, sent_bytes, send, recv = results[rank]
        torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(xgrad, x.grad, rtol=1e-5, atol=1e-6)
        # bytes to other ranks (fp32 rows): the tokens sent away (dispatch forward, combine backward) and
        # the outputs of tokens received from others (combine forward, dispatch backward)
        away = sum(send) - send[rank] + sum(recv) - recv[rank]
        assert sent_bytes == 2 * away * H * 4, (rank, sent_bytes, away)
        total += sum(send)
    local = E // world
    for rank in range(world):  # each rank's expert gradients are its slice of the full model's
        torch.testing.assert_close(results[rank][2], full_w.grad[rank * local:(rank + 1) * local], rtol=1e-5, atol=1e-6)
    expected = sum(int(keep.sum()) if use_keep else T * K for _, _, _, keep in (_inputs(r) for r in range(world)))
    assert total == expected


def test_all_to_all_dispatch_equals_one_process_ep2_with_dropped_assignments():
    _check(2, use_keep=True)


@pytest.mark.slow
def test_all_to_all_dispatch_equals_one_process_ep4_dropless():
    _check(4, use_keep=False)
