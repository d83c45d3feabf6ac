"""The live process groups of a Topology: each one all-reduces to the sum of its members' ranks."""

import torch
import torch.distributed as dist

from megand.core.parallel_layout import ParallelLayout
from megand.core.parallel_state import Topology, rank_groups
from megand.tools.spawn import run_distributed

SIZES = ParallelLayout(tp=2, cp=1, dp=2, pp=2)


def _reduce_each_group():
    topo = Topology(SIZES)
    sums = {}
    for kind, group in topo.groups.items():
        value = torch.tensor([float(topo.rank)])
        dist.all_reduce(value, group=group)
        sums[kind] = value.item()
    return topo.rank, sums, topo.pp_next_rank, topo.pp_prev_rank


def test_each_live_group_reduces_over_its_members():
    expected_lists = rank_groups(SIZES)
    for rank, sums, next_rank, prev_rank in run_distributed(_reduce_each_group, SIZES.world_size):
        for kind, rank_lists in expected_lists.items():
            (members,) = [ranks for ranks in rank_lists if rank in ranks]
            assert sums[kind] == sum(members), (rank, kind)
        (pipeline,) = [ranks for ranks in expected_lists["pp"] if rank in ranks]
        stage = pipeline.index(rank)
        assert next_rank == pipeline[(stage + 1) % 2] and prev_rank == pipeline[(stage - 1) % 2]
