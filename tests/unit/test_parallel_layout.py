"""The one parallel layout value (megand/core/parallel_layout.py): its rules, checked once and read by the
configuration check, the topology's rank grid, the memory estimator and the planner."""

import pytest

from megand.core.parallel_layout import LayoutError, ParallelLayout
from megand.core.parallel_state import rank_groups


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=6, tp=4), r"world size 6 is not divisible by tp\*pp\*cp = 4\*1\*1 = 4"),
    (dict(world_size=8, tp=2, dp=2), r"parallel.dp=2 but world size 8 / \(tp\*pp\*cp = 2\) = 4"),
    (dict(world_size=8, tp=0), r"parallel.tp=0 must be a positive integer"),
    (dict(world_size=8, order="tp-dp-pp"), r"parallel.order='tp-dp-pp' must list each of tp-cp-dp-pp exactly once"),
    (dict(world_size=8, dp_shard=3), r"parallel.dp_shard=3 must be a positive divisor of dp\*cp = 8\*1 = 8"),
    (dict(world_size=6, ep=4), r"parallel.ep=4 must be a positive divisor of dp\*cp = 6\*1 = 6"),
    (dict(world_size=8, tp=4, etp=2), r"parallel.etp=2 must be 1 or parallel.tp=4"),
    (dict(world_size=2, vpp=2), r"parallel.vpp=2 needs parallel.pp >= 2 \(got 1\)"),
    (dict(world_size=2, pp=2, pp_schedule="zbv"), r"zbv runs two chunks per rank in a V.*\(got pp=2, vpp=None\)"),
    (dict(world_size=2, pp=2, pp_schedule="zbx"), r"parallel.pp_schedule='zbx': choose one of"),
])
def test_each_rule_is_refused_naming_the_values(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        ParallelLayout.infer(**kwargs)


def test_derived_sizes():
    layout = ParallelLayout.infer(32, tp=2, pp=2, cp=2, dp_shard=2, ep=2, etp=1, vpp=2, pp_schedule="zbv")
    assert (layout.dp, layout.dp_cp, layout.shard_size, layout.stage_size, layout.world_size) == (4, 8, 2, 16, 32)
    assert (layout.expert_tp, layout.edp, layout.chunks, layout.last_stage_rank) == (1, 8, 2, 0)
    assert ParallelLayout.infer(8, tp=2, pp=2).last_stage_rank == 1
    assert ParallelLayout(tp=4).expert_tp == 4 and ParallelLayout(dp=4).shard_size == 4


def test_the_grid_and_the_estimator_refuse_with_the_layouts_message():
    from megand.tools.estimate_memory import Layout

    message = r"parallel.dp_shard=3 must be a positive divisor of dp\*cp = 4\*1 = 4"
    with pytest.raises(LayoutError, match=message):
        ParallelLayout(dp=4, dp_shard=3)
    with pytest.raises(LayoutError, match=message):
        rank_groups(ParallelLayout(dp=4, dp_shard=3))
    with pytest.raises(LayoutError, match=message):
        Layout.of(dp=4, dp_shard=3)
    layout = Layout.of(tp=2, pp=2, vpp=2, dp=4, ep=2, etp=1, sharding="optim", pp_schedule="dualpipev")
    assert layout.parallel == ParallelLayout(tp=2, pp=2, vpp=2, dp=4, ep=2, etp=1, pp_schedule="dualpipev")
    assert (layout.edp, layout.expert_tp, layout.shards) == (layout.parallel.edp, 1, 4)
