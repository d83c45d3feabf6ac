"""Pipeline schedules are records (megand/core/pipeline_parallel/record.py): a schedule registered once is
what the configuration check, the action lists, the topology, the estimator and the planner read, and no
module compares a schedule's name."""

import ast
import pathlib
import re

import pytest

from megand.core.pipeline_parallel.actions import peak_live_chunks, placement_for, schedule_actions
from megand.core.pipeline_parallel.orders.one_f_one_b import one_f_one_b_order
from megand.core.pipeline_parallel.record import MicrobatchRule, PipelineSchedule
from megand.core.pipeline_parallel.registry import register, schedule_names, schedule_record, unregister

ROOT = pathlib.Path(__file__).resolve().parents[2]

GPIPE = PipelineSchedule(
    name="toy_gpipe", title="GPipe", summary="every forward, then every backward",
    order=lambda pp, vpp, rank, m: one_f_one_b_order(pp, rank, m, num_warmup=m), chunks=1, min_pp=2,
    needs="needs parallel.pp >= 2 and one chunk per rank",
    microbatches=lambda pp, vpp: MicrobatchRule(who="parallel.pp_schedule=toy_gpipe", minimum=pp,
                                                minimum_is=f"pp = {pp}"))


@pytest.fixture
def toy():
    register(GPIPE)
    yield GPIPE
    unregister(GPIPE.name)


def test_a_registered_schedule_is_read_everywhere(toy):
    from megand.training.config import ConfigError, compose, validate

    base = ["+experiment=tiny_gpt", "parallel.pp_schedule=toy_gpipe", "train.micro_batch_size=1"]
    validate(compose([*base, "parallel.pp=2"]), 2)
    with pytest.raises(ConfigError, match=r"toy_gpipe needs parallel.pp >= 2 and one chunk per rank "
                                          r"\(got pp=2, vpp=2\)"):
        validate(compose([*base, "parallel.pp=2", "parallel.vpp=2"]), 2)
    with pytest.raises(ConfigError, match=r"reaches a global batch of 1: 1 micro-batches, fewer than the pp = 2"):
        validate(compose([*base, "parallel.pp=2", "train.rampup_batch_size=[1,1,4]"]), 2)
    assert "toy_gpipe" in schedule_names()
    actions = schedule_actions(2, None, 4, 0, schedule="toy_gpipe")
    assert [a.kind for a in actions] == ["F"] * 4 + ["B"] * 4
    assert placement_for(2, None, "toy_gpipe").last_rank == 1
    assert peak_live_chunks(2, None, 4, 0, "toy_gpipe") == 4  # GPipe holds every micro-batch
    with pytest.raises(ValueError, match="at least pp = 2 micro-batches per step, got 1"):
        schedule_actions(2, None, 1, 0, schedule="toy_gpipe")


def test_the_planner_searches_a_registered_schedule(toy):
    from megand.tools.planner.search import Planner

    planner = Planner.__new__(Planner)
    planner.pinned = {}
    assert "toy_gpipe" in planner._schedule_domain(None)
    planner.schedule_domain = planner._schedule_domain(None)
    assert "toy_gpipe" in planner.schedules(2, None) and "toy_gpipe" not in planner.schedules(2, 2)


def test_the_layout_reads_the_last_stage_from_the_placement():
    from megand.core.parallel_layout import ParallelLayout

    for schedule, vpp, last in (("1f1b", None, 3), ("1f1b", 2, 3), ("zb1p", None, 3), ("zbv", 2, 0),
                                ("dualpipev", 2, 0)):
        layout = ParallelLayout(pp=4, vpp=vpp, pp_schedule=schedule)
        assert layout.last_stage_rank == last == placement_for(4, vpp, schedule).last_rank


def test_unknown_and_duplicate_names_are_refused():
    with pytest.raises(ValueError, match="'zbx': choose one of 1f1b, zb1p, zbv, dualpipev"):
        schedule_record("zbx")
    with pytest.raises(ValueError, match="registered already"):
        register(schedule_record("zbv"))


def test_the_docs_table_lists_every_registered_schedule():
    text = (ROOT / "docs" / "parallelism.md").read_text()
    table = text[text.index("| `pp_schedule` |"):]
    table = table[:table.index("\n\n")]
    listed = re.findall(r"^\s*\| `([\w-]+)`", table, flags=re.M)
    assert listed[1:] == list(schedule_names())  # the first is the header


def _compared_names(path, names):
    """Lines of ``path`` that compare a value with a schedule name (``==``, ``!=``, ``in``, ``not in``)."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        for operand in [node.left, *node.comparators]:
            values = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
            if any(isinstance(v, ast.Constant) and v.value in names for v in values):
                hits.append(node.lineno)
    return hits


def test_no_module_compares_a_schedule_name():
    names = set(schedule_names())
    orders = ROOT / "megand" / "core" / "pipeline_parallel" / "orders"
    found = {}
    for path in [p for top in ("megand", "tools", "benchmarks") for p in (ROOT / top).rglob("*.py")]:
        if orders in path.parents:
            continue
        hits = _compared_names(path, names)
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert not found, found
