"""Start-up at scale: how many process groups a rank creates for a 1024-rank layout.

Where subgroups are communicator splits (NCCL bound to a device), every ``new_group`` is a split over the
whole world, so creating one group per rank list costs each rank over a thousand world-wide splits at 1024
ranks. The count is taken with stand-ins for torch.distributed's group calls (no processes)."""

import pytest
import torch.distributed as dist

from megand.core import parallel_state
from megand.core.parallel_layout import ParallelLayout
from megand.core.parallel_state import PIPELINE_CHANNELS, Topology, rank_groups, tp_run_groups

LAYOUT = ParallelLayout(tp=8, cp=2, dp=8, pp=8, dp_shard=16, ep=4)  # 1024 ranks


def all_lists():
    """Every group kind a rank makes: the grid's, and the runs of tp ranks sharing a key/value head."""
    lists = rank_groups(LAYOUT)
    return {**lists, **tp_run_groups(lists["tp"])}


KINDS = len(all_lists())


class Calls:
    def __init__(self, monkeypatch, rank: int, splits: bool):
        self.new_group, self.split_group = [], []
        monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: LAYOUT.world_size)
        monkeypatch.setattr(parallel_state, "splits_communicators", lambda: splits)
        monkeypatch.setattr(dist, "new_group", self.record_new_group)
        monkeypatch.setattr(dist, "split_group", self.record_split)

    def record_new_group(self, ranks=None, timeout=None, **kwargs):
        self.new_group.append(tuple(ranks))
        return ("group", tuple(ranks))

    def record_split(self, parent_pg=None, split_ranks=None, timeout=None, **kwargs):
        self.split_group.append(split_ranks)
        mine = [r for r in split_ranks if self.rank in r]
        return ("group", tuple(mine[0])) if mine else None


@pytest.mark.parametrize("rank", [0, 1023])
def test_a_1024_rank_layout_makes_one_communicator_split_per_distinct_kind(monkeypatch, rank):
    calls = Calls(monkeypatch, rank, splits=True)
    calls.rank = rank
    topo = Topology(LAYOUT)  # dp_shard = dp x cp: the shard groups are the dp_cp groups
    # one split per distinct kind (dp_shard shares dp_cp's; the size-1 replica groups are one split), none
    # per group (2736 world-wide splits per rank when each rank list was its own new_group); the pipeline's
    # p2p takes three more splits of the pp groups (a group per message kind and direction)
    extra = PIPELINE_CHANNELS - 1
    assert calls.new_group == [] and len(calls.split_group) <= KINDS - 1 + extra, (len(calls.new_group),
                                                                                   len(calls.split_group))
    assert calls.split_group[-extra:] == [rank_groups(LAYOUT)["pp"]] * extra
    for kind, group in topo.groups.items():
        assert group == ("group", tuple(topo.ranks[kind])), kind
    assert topo.pp_channel_groups[0] is topo.groups["pp"] and len({id(g) for g in topo.pp_channel_groups}) == 4
    assert all(g == ("group", tuple(topo.ranks["pp"])) for g in topo.pp_channel_groups)


def test_without_communicator_splits_each_distinct_group_is_made_once(monkeypatch):
    calls = Calls(monkeypatch, 5, splits=False)
    calls.rank = 5
    topo = Topology(LAYOUT)
    lists = all_lists()
    distinct = {tuple(r) for rank_lists in lists.values() for r in rank_lists}
    # and the pipeline p2p's three more groups per pipeline (the same ranks as the pp group)
    assert len(calls.new_group) == len(distinct) + (PIPELINE_CHANNELS - 1) * len(lists["pp"])
    assert set(calls.new_group) == distinct
    assert topo.groups["dp_shard"] is topo.groups["dp_cp"]
    for kind, group in topo.groups.items():
        assert group == ("group", tuple(topo.ranks[kind])), kind


@pytest.mark.parametrize("rank", [0, 100, 191])
def test_stages_of_different_widths_make_one_split_per_kind(monkeypatch, rank):
    """Stage widths [8, 4] (cp 2, dp 8: 192 ranks): still one world-wide split per distinct kind; the
    pipeline's communicators join one (dp, cp) coordinate over both stages, and the rank's pipeline view
    (its source in each stage) lies inside them."""
    layout = ParallelLayout(cp=2, dp=8, pp=2, stage_tp=(8, 4))
    calls = Calls(monkeypatch, rank, splits=True)
    calls.rank = rank
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: layout.world_size)
    topo = Topology(layout)
    lists = rank_groups(layout)
    lists.update(tp_run_groups(lists["tp"]))
    distinct = {tuple(map(tuple, v)) for v in lists.values()}
    assert calls.new_group == [] and len(calls.split_group) == len(distinct) + PIPELINE_CHANNELS - 1
    assert topo.tp_size == (8 if rank < 128 else 4) and topo.pp_rank == (rank >= 128)
    for kind, group in topo.groups.items():
        if kind != "pp":
            assert group == ("group", tuple(topo.ranks[kind])), kind
    assert set(topo.ranks["pp"]) <= set(topo.groups["pp"][1]) and topo.ranks["pp"][topo.pp_rank] == rank
