"""The expert grid (ep, etp, expert dp) as a pure function, checked against Megatron-core's RankGenerator
semantics: experts use a second grid over the same ranks, in the dense order with tp read as ``tp-ep``
(etp first, ep adjacent after it), cp folded away (size 1) and dp the expert-data-parallel size."""

import pytest

from megand.core.parallel_layout import ParallelLayout
from megand.core.parallel_state import (
    LayoutError,
    all_decompositions,
    expert_rank_groups,
    rank_groups,
)


def megatron_groups(sizes_in_order: list[int], names: list[str], token: str) -> list[list[int]]:
    """RankGenerator.get_ranks(token) written from its definition: ``global = sum(coord_i * stride_i)``
    with the first name fastest; one group per value of the unmasked coordinates, its members the
    masked coordinates' combinations."""
    strides, s = [], 1
    for n in sizes_in_order:
        strides.append(s)
        s *= n
    masked = [i for i, name in enumerate(names) if name in token.split("-")]
    unmasked = [i for i in range(len(names)) if i not in masked]

    def combos(idx):
        out = [0]
        for i in idx:
            out = [base + c * strides[i] for c in range(sizes_in_order[i]) for base in out]
        return out

    return [sorted(u + m for m in combos(masked)) for u in combos(unmasked)]


def megatron_expert_groups(sizes: ParallelLayout, order: str, ep: int, etp: int) -> dict:
    names = order.replace("tp", "tp-ep").split("-")  # cp stays, with size 1 in the expert generator
    size = {"tp": etp, "ep": ep, "cp": 1, "dp": sizes.world_size // (etp * ep * sizes.pp), "pp": sizes.pp}
    ordered = [size[n] for n in names]
    return {"ep": megatron_groups(ordered, names, "ep"), "etp": megatron_groups(ordered, names, "tp"),
            "expert_dp": megatron_groups(ordered, names, "dp"), "pp": megatron_groups(ordered, names, "pp"),
            "expert_tp_ep": megatron_groups(ordered, names, "tp-ep")}


def expert_layouts():
    for world in range(1, 17):
        for sizes in all_decompositions(world):
            for ep in (e for e in range(2, sizes.dp * sizes.cp + 1) if sizes.dp * sizes.cp % e == 0):
                for etp in sorted({1, sizes.tp}):
                    yield sizes, ep, etp


@pytest.mark.parametrize("order", ["tp-cp-dp-pp", "tp-dp-cp-pp"])
def test_expert_groups_equal_megatron_rank_generator(order):
    count = 0
    for sizes, ep, etp in expert_layouts():
        ours = expert_rank_groups(sizes.with_(order=order, ep=ep, etp=etp))
        ref = megatron_expert_groups(sizes, order, ep, etp)
        for kind in ("ep", "etp", "expert_dp", "expert_tp_ep"):
            assert sorted(ours[kind]) == sorted(ref[kind]), (sizes, ep, etp, kind)
        assert sorted(ref["pp"]) == rank_groups(sizes.with_(order=order))["pp"]  # Megatron's own consistency assertion
        count += 1
    assert count > 100  # many layouts were checked


def test_expert_groups_partition_the_world_and_hold_distinct_experts():
    for sizes, ep, etp in expert_layouts():
        groups = expert_rank_groups(sizes.with_(ep=ep, etp=etp))
        dense = rank_groups(sizes)
        for kind, size in (("ep", ep), ("etp", etp), ("expert_dp", sizes.world_size // (ep * etp * sizes.pp))):
            assert sorted(r for g in groups[kind] for r in g) == list(range(sizes.world_size))
            assert all(len(g) == size for g in groups[kind]), (sizes, ep, etp, kind)
        same_stage = {r: [g for g in dense["pp"] if r in g][0].index(r) for r in range(sizes.world_size)}
        for g in groups["ep"] + groups["expert_dp"]:  # every exchange stays on one pipeline stage
            assert len({same_stage[r] for r in g}) == 1, (sizes, ep, etp, g)
        if etp == sizes.tp:
            assert groups["etp"] == dense["tp"]


def test_expert_group_examples():
    # 8 ranks, tp=2, dp=4: ep ranks adjacent after tp (stride 2), expert dp across them
    g = expert_rank_groups(ParallelLayout(tp=2, dp=4, ep=2))
    assert g["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["etp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["expert_dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # etp=1: ep ranks are the fastest (the tp peers), experts replicated over tp join the expert dp group
    g = expert_rank_groups(ParallelLayout(tp=2, dp=4, ep=2, etp=1))
    assert g["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["expert_dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # cp folds into expert dp: tp=1 cp=2 dp=2 ep=4 spans every rank of the stage
    g = expert_rank_groups(ParallelLayout(cp=2, dp=2, pp=2, ep=4))
    assert g["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and g["expert_dp"] == [[r] for r in range(8)]


def test_ep_one_follows_the_dense_grid_in_any_order():
    for order in ("tp-cp-dp-pp", "dp-tp-pp-cp", "pp-dp-cp-tp"):
        for sizes in all_decompositions(12):
            dense = rank_groups(sizes.with_(order=order))
            g = expert_rank_groups(sizes.with_(order=order))
            assert g["etp"] == dense["tp"] and g["expert_dp"] == dense["dp_cp"] and g["ep"] == [[r] for r in range(12)]
            g1 = expert_rank_groups(sizes.with_(order=order, etp=1))
            assert sorted(len(x) for x in g1["expert_dp"]) == [sizes.tp * sizes.dp * sizes.cp] * sizes.pp


def test_expert_layout_errors_name_the_values():
    with pytest.raises(LayoutError, match=r"parallel.ep=3 must be a positive divisor of dp\*cp = 2\*2 = 4"):
        ParallelLayout(cp=2, dp=2, ep=3)
    with pytest.raises(LayoutError, match=r"parallel.etp=2 must be 1 or parallel.tp=4"):
        ParallelLayout(tp=4, dp=2, ep=2, etp=2)
    with pytest.raises(LayoutError, match=r"parallel.order='pp-dp-cp-tp' with ep=2"):
        expert_rank_groups(ParallelLayout(tp=2, dp=2, pp=2, order="pp-dp-cp-tp", ep=2))


def test_tp_ep_group_lists_ranks_etp_fastest():
    """The dispatcher reads the count matrix of the (etp x ep) group as row ``etp_rank + etp * ep_rank``."""
    for sizes, ep, etp in expert_layouts():
        g = expert_rank_groups(sizes.with_(ep=ep, etp=etp))
        group_of = {kind: {r: grp for grp in g[kind] for r in grp} for kind in ("ep", "etp")}
        for members in g["expert_tp_ep"]:
            for r in members:
                assert members.index(r) == group_of["etp"][r].index(r) + etp * group_of["ep"][r].index(r)
