"""The seeds of the dropout streams, for every rank of every layout (no processes needed)."""

from types import SimpleNamespace

import pytest
import torch

from megand.core.parallel_state import all_decompositions
from megand.core.tensor_parallel.random import TP_OFFSET, TensorParallelRNG, default_seed

SEED = 1234


def topo(sizes, rank):
    c = sizes.coords(rank)
    return SimpleNamespace(**{f"{d}_rank": c[d] for d in c}, **{f"{d}_size": getattr(sizes, d) for d in c})


@pytest.mark.parametrize("world", [8, 64])
def test_every_rank_gets_its_own_streams(world):
    for sizes in all_decompositions(world):
        ranks = [topo(sizes, r) for r in range(world)]
        default = {(t.pp_rank, t.cp_rank, t.dp_rank): default_seed(SEED, t) for t in ranks}
        tp = {(t.pp_rank, t.cp_rank, t.dp_rank, t.tp_rank): default_seed(SEED, t) + TP_OFFSET + t.tp_rank
              for t in ranks}
        # one default seed per (pp, cp, dp), shared by its tp peers; one tensor-parallel seed per rank
        assert len(set(default.values())) == len(default) == world // sizes.tp, sizes
        assert len(set(tp.values())) == len(tp) == world, sizes
        assert not set(default.values()) & set(tp.values()), sizes


def test_megatron_seeds_without_cp_and_dp():
    for sizes in all_decompositions(8):
        if sizes.cp == sizes.dp == 1:
            for r in range(8):
                t = topo(sizes, r)
                assert default_seed(SEED, t) == SEED + 100 * t.pp_rank


def test_tensor_parallel_stream_leaves_the_default_generator_alone():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    rng = TensorParallelRNG(SEED, 1, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), before)
    with rng.fork():
        drawn = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(drawn, torch.rand(4, generator=torch.Generator().manual_seed(SEED + TP_OFFSET + 1)))
