"""The cost model against published large-scale runs (the "Published runs" table of docs/layout.md)."""

import pytest

from megand.tools.planner.published import RUNS, evaluate

NAMES = [run.name for run in RUNS]


@pytest.mark.parametrize("run", RUNS, ids=NAMES)
def test_published_layout_is_predicted_within_20_percent(run):
    row = evaluate(run, search=False)
    c = row["published_plan"].candidate
    for key, value in run.layout.items():  # the published layout itself was predicted
        assert getattr(c, key) == value, key
    assert abs(row["error"]) <= 0.20, f"{run.name}: predicted {row['predicted_tflops']:.0f} TFLOP/s per GPU"


def _top_at_least_as_fast(run):
    row = evaluate(run, search=True)
    assert row["top_tokens_per_s"] >= row["predicted_tokens_per_s"]
    assert row["top_plan"].world_size <= run.gpus


@pytest.mark.slow  # 40 s of search; the planner's search runs in the default suite in test_plan_tool,
# test_planner_recompute and test_planner_fp8
def test_planner_top_plan_is_at_least_as_fast_as_a_published_layout():
    _top_at_least_as_fast(RUNS[2])  # GPT 529.6B on 2520 A100


@pytest.mark.slow
@pytest.mark.parametrize("run", [r for i, r in enumerate(RUNS) if i != 2], ids=[n for i, n in enumerate(NAMES) if i != 2])
def test_planner_top_plans_are_at_least_as_fast_as_the_published_layouts(run):
    _top_at_least_as_fast(run)
