"""This rank's share of the global batch: data-parallel slices, context-parallel chunks, token-free stages."""

from types import SimpleNamespace

import torch

from megand.data.mock import MockGPTDataset
from megand.training.batches import rank_microbatches


def topo(dp_rank=0, dp_size=1, cp_rank=0, cp_size=1, dp_microbatches=None):
    return SimpleNamespace(dp_rank=dp_rank, dp_size=dp_size, cp_rank=cp_rank, cp_size=cp_size,
                           dp_microbatches=dp_microbatches, device=torch.device("cpu"))


def samples(mb):
    return {tuple(row.tolist()) for row in mb.input_ids}


def test_data_parallel_ranks_take_contiguous_slices_of_the_same_global_batch():
    data = MockGPTDataset(16, 100, seed=1, num_samples=64)
    ranks = [rank_microbatches(data, 2, 8, 2, topo(r, 2)) for r in range(2)]
    for r, mbs in enumerate(ranks):  # iteration 2 starts at sample 16; rank r holds [16 + 4r, 20 + 4r)
        assert set().union(*map(samples, mbs)) == {tuple(data[16 + 4 * r + i][:-1].tolist()) for i in range(4)}
    assert torch.equal(ranks[0][0].input_ids[0], torch.from_numpy(data[16][:-1]))


def test_each_microbatch_of_the_step_holds_the_same_samples_at_every_dp():
    """Micro-batch j of the step (every dp rank's j-th) is micro-batch j of one process taking dp x
    micro_batch_size samples per micro-batch: the MoE balancing losses, over each micro-batch's tokens on
    every dp rank, then match the one-process run (consecutive micro-batches of each dp rank's contiguous
    slice grouped samples 0,1 with 4,5 at dp=2, which no one-process micro-batch holds together)."""
    data = MockGPTDataset(16, 100, seed=1, num_samples=64)
    for dp, mbs in ((2, 2), (4, 1), (2, 1), (4, 2)):
        one = rank_microbatches(data, 1, 16, dp * mbs, topo())
        ranks = [rank_microbatches(data, 1, 16, mbs, topo(r, dp)) for r in range(dp)]
        assert len(one) == len(ranks[0])
        for j, mb in enumerate(one):
            assert samples(mb) == set().union(*(samples(rank[j]) for rank in ranks)), (dp, mbs, j)


def test_context_parallel_chunks_keep_global_positions():
    data = MockGPTDataset(16, 100, seed=1, num_samples=8)
    (mb,) = rank_microbatches(data, 0, 2, 2, topo(cp_rank=0, cp_size=2))
    assert mb.positions.tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert torch.equal(mb.labels[0], torch.from_numpy(data[0][1:])[mb.positions])


def test_a_stage_without_embedding_or_loss_reads_no_tokens():
    class Untouchable:
        def __getitem__(self, i):
            raise AssertionError("a middle pipeline stage must not read samples")

    mbs = rank_microbatches(Untouchable(), 0, 8, 2, topo(), seq_length=16, needs_tokens=False)
    assert len(mbs) == 4 and all(mb.input_ids is None and mb.labels is None for mb in mbs)
    assert mbs[0].positions.tolist() == list(range(16)) and mbs[0].batch_size == 2
