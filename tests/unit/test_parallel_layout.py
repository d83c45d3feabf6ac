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


def test_the_config_keys_make_the_layout_once():
    keys = {"tp": 2, "pp": 2, "cp": 1, "dp": None, "vpp": 2, "order": "tp-dp-cp-pp", "sequence_parallel": True}
    layout = ParallelLayout.from_keys(keys, world_size=16)
    assert layout == ParallelLayout(tp=2, pp=2, dp=4, vpp=2, order="tp-dp-cp-pp")
    assert ParallelLayout.world_of(keys) == 4 and ParallelLayout.world_of({**keys, "dp": 3}) == 12
    with pytest.raises(LayoutError, match="parallel.dp is null: pass world_size"):
        ParallelLayout.from_keys(keys)
    with pytest.raises(LayoutError, match=r"parallel.dp=2 but world size 16"):
        ParallelLayout.from_keys({**keys, "dp": 2}, world_size=16)
    # the rank grid, micro-batches and the rehearsal's steady state are read from the value
    assert layout.coords(5) == {"tp": 1, "dp": 2, "cp": 0, "pp": 0} and layout.coords(8)["pp"] == 1
    assert (layout.model_ranks, layout.microbatches(64, 2), layout.steady_microbatches) == (4, 8, 4)
    assert ParallelLayout(pp=4).steady_microbatches == 4 and ParallelLayout().steady_microbatches == 2


def test_a_search_gets_the_error_instead_of_an_exception():
    from megand.tools.planner.layout import Candidate

    error = ParallelLayout.or_error(dp=4, dp_shard=3)
    assert isinstance(error, LayoutError) and "parallel.dp_shard=3" in str(error)
    assert Candidate.or_none(dp=4, dp_shard=3, micro_batch_size=2) is None
    c = Candidate.or_none(tp=2, pp=2, dp=2, micro_batch_size=2, sharding="optim")
    assert c.parallel == ParallelLayout(tp=2, pp=2, dp=2) and (c.world_size, c.stage_size, c.dp) == (8, 4, 2)
    assert c.with_(dp=4).parallel.dp == 4 and c.with_(recompute="full").parallel is c.parallel
    with pytest.raises(LayoutError, match="parallel.dp_shard=3"):
        Candidate.of(dp=4, dp_shard=3)


def test_the_estimator_and_the_planner_hold_the_layout_value():
    from megand.tools.estimate_memory import Layout
    from megand.tools.planner.cost import memory_layout
    from megand.tools.planner.layout import Candidate

    c = Candidate.of(tp=2, pp=4, vpp=2, dp=2, dp_shard=2, sharding="optim")
    assert memory_layout(c, 8).parallel is c.parallel
    layout = Layout.of(tp=2, pp=2, dp=4, ep=2, sharding="optim")
    assert Layout.of(**layout.as_dict()) == layout


def test_sizes_are_declared_once():
    """Only the layout value declares the parallel sizes as fields (and the Hydra schema, the user's input):
    every other layout struct holds a ParallelLayout and reads them from it."""
    import ast
    import pathlib

    import megand

    declaring = []
    for path in sorted(pathlib.Path(megand.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
                if len(names & {"tp", "pp", "cp", "dp"}) >= 2:
                    declaring.append(node.name)
    assert sorted(declaring) == ["ParallelConfig", "ParallelLayout"]
