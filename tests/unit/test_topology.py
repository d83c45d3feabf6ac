"""The rank grid as a pure function: every decomposition of 1..16 ranks, without processes."""

import pytest

from megand.core.parallel_layout import ParallelLayout
from megand.core.parallel_state import (
    GROUP_DIMS,
    LayoutError,
    all_decompositions,
    rank_groups,
)

ORDERS = ["tp-cp-dp-pp", "tp-dp-cp-pp", "dp-tp-pp-cp", "pp-dp-cp-tp"]


def layouts():
    for world in range(1, 17):
        for sizes in all_decompositions(world):
            yield sizes


@pytest.mark.parametrize("order", ORDERS)
def test_every_rank_in_exactly_one_group_of_each_kind(order):
    for sizes in layouts():
        groups = rank_groups(sizes.with_(order=order))
        ends = sorted(r for ranks in groups["pp"] for r in {ranks[0], ranks[-1]})
        for kind, rank_lists in groups.items():
            members = sorted(r for ranks in rank_lists for r in ranks)
            everyone = ends if kind == "embedding" else list(range(sizes.world_size))
            assert members == everyone, (sizes, order, kind)
            expected = {"dp_shard": sizes.dp * sizes.cp, "dp_replica": 1,  # dp_shard=None: no HSDP
                        "etp": sizes.tp, "expert_tp_ep": sizes.tp,  # ep=1: experts follow tp
                        "expert_dp": sizes.dp * sizes.cp}.get(kind, 1)
            for dim in GROUP_DIMS.get(kind, ()):
                expected *= getattr(sizes, dim)
            if kind != "embedding":
                assert all(len(ranks) == expected for ranks in rank_lists), (sizes, order, kind)


@pytest.mark.parametrize("order", ORDERS)
def test_group_members_differ_only_in_their_dims(order):
    for sizes in layouts():
        coords = [sizes.with_(order=order).coords(r) for r in range(sizes.world_size)]
        for kind, spanned in GROUP_DIMS.items():
            for ranks in rank_groups(sizes.with_(order=order))[kind]:
                for dim in ("tp", "cp", "dp", "pp"):
                    values = {coords[r][dim] for r in ranks}
                    assert len(values) == (getattr(sizes, dim) if dim in spanned else 1), (sizes, kind, dim)


def test_order_sets_which_dimension_varies_fastest():
    sizes = ParallelLayout(tp=2, cp=2, dp=2, pp=2)
    groups = rank_groups(sizes)  # default tp-cp-dp-pp: tp neighbours, pp farthest apart
    assert groups["tp"][0] == [0, 1]
    assert groups["cp"][0] == [0, 2]
    assert groups["dp"][0] == [0, 4]
    assert groups["pp"][0] == [0, 8]
    assert groups["dp_cp"][0] == [0, 2, 4, 6]
    assert groups["mp"][0] == [0, 1, 8, 9]
    assert groups["embedding"][0] == [0, 8]
    other = rank_groups(sizes.with_(order="pp-dp-cp-tp"))
    assert other["pp"][0] == [0, 1] and other["tp"][0] == [0, 8]


def test_pipeline_groups_are_in_stage_order_and_embedding_joins_ends():
    sizes = ParallelLayout(tp=2, dp=1, pp=4)
    for ranks, embedding in zip(rank_groups(sizes)["pp"], rank_groups(sizes)["embedding"]):
        stages = [sizes.coords(r)["pp"] for r in ranks]
        assert stages == [0, 1, 2, 3]
        assert embedding == [ranks[0], ranks[-1]]


def test_invalid_sizes_are_named():
    with pytest.raises(LayoutError, match=r"world size 6 is not divisible by tp\*pp\*cp = 4\*1\*1 = 4"):
        ParallelLayout.infer(6, tp=4)
    with pytest.raises(LayoutError, match="parallel.dp=3"):
        ParallelLayout.infer(8, tp=2, dp=3)
    with pytest.raises(LayoutError, match="parallel.order"):
        ParallelLayout(order="tp-cp-dp")
    assert ParallelLayout.infer(8, tp=2, pp=2) == ParallelLayout(tp=2, cp=1, dp=2, pp=2)


def test_hsdp_shard_groups_are_adjacent_runs_of_dp_cp_and_replicas_cross_them():
    for world in range(1, 17):
        for sizes in all_decompositions(world):
            dp_cp = sizes.dp * sizes.cp
            for shard in (d for d in range(1, dp_cp + 1) if dp_cp % d == 0):
                groups = rank_groups(sizes.with_(dp_shard=shard))
                for kind in ("dp_shard", "dp_replica"):
                    assert sorted(r for g in groups[kind] for r in g) == list(range(world)), (sizes, shard, kind)
                for big in groups["dp_cp"]:
                    shards = [g for g in groups["dp_shard"] if g[0] in big]
                    assert [r for g in sorted(shards) for r in g] == big, (sizes, shard)  # adjacent runs, in order
                    replicas = [g for g in groups["dp_replica"] if g[0] in big]
                    assert len(replicas) == shard and all(len(g) == dp_cp // shard for g in replicas)
                    for g in replicas:  # one member from every shard group, at the same place in each
                        assert len({s.index(r) for s in shards for r in g if r in s}) == 1


def test_hsdp_example_dp4_shard2():
    groups = rank_groups(ParallelLayout(tp=2, dp=4, dp_shard=2))
    assert groups["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups["dp_shard"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp_replica"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_dp_shard_must_divide_dp_cp():
    with pytest.raises(LayoutError, match="dp_shard=3 .* dp\\*cp = 4"):
        ParallelLayout(dp=4, dp_shard=3)
