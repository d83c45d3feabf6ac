"""The rank grid as a pure function: every decomposition of 1..16 ranks, without processes."""

import pytest

from megand.core.parallel_state import (
    GROUP_DIMS,
    LayoutError,
    ParallelSizes,
    all_decompositions,
    rank_coords,
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
        groups = rank_groups(sizes, order)
        ends = sorted(r for ranks in groups["pp"] for r in {ranks[0], ranks[-1]})
        for kind, rank_lists in groups.items():
            members = sorted(r for ranks in rank_lists for r in ranks)
            everyone = ends if kind == "embedding" else list(range(sizes.world_size))
            assert members == everyone, (sizes, order, kind)
            expected = 1
            for dim in GROUP_DIMS.get(kind, ()):
                expected *= getattr(sizes, dim)
            if kind != "embedding":
                assert all(len(ranks) == expected for ranks in rank_lists), (sizes, order, kind)


@pytest.mark.parametrize("order", ORDERS)
def test_group_members_differ_only_in_their_dims(order):
    for sizes in layouts():
        coords = [rank_coords(r, sizes, order) for r in range(sizes.world_size)]
        for kind, spanned in GROUP_DIMS.items():
            for ranks in rank_groups(sizes, order)[kind]:
                for dim in ("tp", "cp", "dp", "pp"):
                    values = {coords[r][dim] for r in ranks}
                    assert len(values) == (getattr(sizes, dim) if dim in spanned else 1), (sizes, kind, dim)


def test_order_sets_which_dimension_varies_fastest():
    sizes = ParallelSizes(tp=2, cp=2, dp=2, pp=2)
    groups = rank_groups(sizes)  # default tp-cp-dp-pp: tp neighbours, pp farthest apart
    assert groups["tp"][0] == [0, 1]
    assert groups["cp"][0] == [0, 2]
    assert groups["dp"][0] == [0, 4]
    assert groups["pp"][0] == [0, 8]
    assert groups["dp_cp"][0] == [0, 2, 4, 6]
    assert groups["mp"][0] == [0, 1, 8, 9]
    assert groups["embedding"][0] == [0, 8]
    other = rank_groups(sizes, "pp-dp-cp-tp")
    assert other["pp"][0] == [0, 1] and other["tp"][0] == [0, 8]


def test_pipeline_groups_are_in_stage_order_and_embedding_joins_ends():
    sizes = ParallelSizes(tp=2, dp=1, pp=4)
    for ranks, embedding in zip(rank_groups(sizes)["pp"], rank_groups(sizes)["embedding"]):
        stages = [rank_coords(r, sizes)["pp"] for r in ranks]
        assert stages == [0, 1, 2, 3]
        assert embedding == [ranks[0], ranks[-1]]


def test_invalid_sizes_are_named():
    with pytest.raises(LayoutError, match=r"world size 6 is not divisible by tp\*pp\*cp = 4\*1\*1 = 4"):
        ParallelSizes.infer(6, tp=4)
    with pytest.raises(LayoutError, match="parallel.dp=3"):
        ParallelSizes.infer(8, tp=2, dp=3)
    with pytest.raises(LayoutError, match="parallel.order"):
        rank_groups(ParallelSizes(), "tp-cp-dp")
    assert ParallelSizes.infer(8, tp=2, pp=2) == ParallelSizes(tp=2, cp=1, dp=2, pp=2)
