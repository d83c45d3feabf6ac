import pytest
import torch

from megand.core.context_parallel import cp_positions, merge_cp_shards, split_for_cp


def test_positions_load_balanced():
    # 16 tokens, cp=2 -> 4 chunks of 4: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert cp_positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert cp_positions(8, 0, 1).tolist() == list(range(8))
    assert cp_positions(8, 0, 4).dtype == torch.long
    # every token on exactly one rank
    for cp in (1, 2, 4):
        assert sorted(torch.cat([cp_positions(32, r, cp) for r in range(cp)]).tolist()) == list(range(32))


def test_causal_work_is_balanced():
    # number of (query, key) pairs under the causal mask is the same on every rank
    for cp in (2, 4):
        work = [(cp_positions(64, r, cp) + 1).sum().item() for r in range(cp)]
        assert len(set(work)) == 1, work


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_split_merge_roundtrip(cp):
    x = torch.randn(2, 3, 16, 5)
    shards = [split_for_cp(x, 2, r, cp) for r in range(cp)]
    for r, shard in enumerate(shards):
        assert torch.equal(shard, x[:, :, cp_positions(16, r, cp)])
    assert torch.equal(merge_cp_shards(shards, 2), x)
