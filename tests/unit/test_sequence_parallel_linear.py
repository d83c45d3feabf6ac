"""The column-parallel product under sequence parallelism stores only this rank's sequence shard for
backward (the gathered input is tp times larger), and its gradients are those of ``F.linear``."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megand.core.parallel_state import init_fake_distributed
from megand.core.tensor_parallel.layers import ParallelLinear


def saved_bytes(fn):
    """Bytes of the distinct storages autograd saves while ``fn`` runs (parameters included)."""
    storages = {}

    def pack(t):
        storages[id(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def test_only_the_local_sequence_shard_is_saved():
    init_fake_distributed(0, 4)  # rank 0 of a tp group of 4 (collectives exchange nothing)
    try:
        weight = torch.nn.Parameter(torch.randn(32, 64))
        x = torch.randn(8, 2, 64, requires_grad=True)  # this rank's 8 of 32 tokens
        _, saved = saved_bytes(lambda: ParallelLinear.apply(x, weight, None, dist.group.WORLD, True, True))
        assert saved == x.nbytes + weight.nbytes, f"saved {saved} bytes; shard {x.nbytes} + weight {weight.nbytes}"
    finally:
        dist.destroy_process_group()


def test_gradients_equal_those_of_f_linear_on_one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        x, w, b = torch.randn(6, 3, 16), torch.randn(8, 16), torch.randn(8)
        grad = torch.randn(6, 3, 8)
        grads = []
        for f in (lambda x, w, b: ParallelLinear.apply(x, w, b, dist.group.WORLD, True, True), F.linear):
            leaves = [t.clone().requires_grad_() for t in (x, w, b)]
            f(*leaves).backward(grad)
            grads.append([t.grad for t in leaves])
        for mine, reference in zip(*grads):
            torch.testing.assert_close(mine, reference, rtol=1e-6, atol=1e-6)
    finally:
        dist.destroy_process_group()
