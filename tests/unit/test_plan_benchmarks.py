"""The planner benchmarks' pieces (the measurements themselves are benchmarks, not tests): rank
statistics, the steady step time, and that every layout they run is valid and predicted."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


plan_runs = load("plan_runs")


def test_spearman():
    assert plan_runs.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert plan_runs.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # one swapped pair of 5: 1 - 6 * 2 / (5 * 24)
    assert plan_runs.spearman([1, 2, 3, 4, 5], [1, 3, 2, 4, 5]) == pytest.approx(0.9)
    assert plan_runs.ranks([5.0, 1.0, 5.0, 2.0]) == [3.5, 1.0, 3.5, 2.0]  # ties share their mean rank


def test_steady_step_time(tmp_path):
    rows = [{"iter": i, "loss": 1.0, "iter_time_ms": t} for i, t in enumerate([900, 300, 200, 100, 120, 110], 1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plan_runs.steady_step_s(str(tmp_path)) == pytest.approx(0.110)


def test_every_accuracy_layout_is_valid_and_predicted(tmp_path):
    from megand.tools.calibration.predict import candidate_of

    plan_accuracy = load("plan_accuracy")
    profile = tmp_path / "cpu.json"
    coll = {op: {"alpha_s": 1e-4, "gbps": 1.0} for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p", "all_to_all")}
    profile.write_text(json.dumps({
        "name": "synthetic", "peak_tflops": 0.1, "memory_gbps": 20.0,
        "gemm": [{"m": m, "n": n, "k": k, "tflops": 0.1} for m in (32, 2048) for n in (32, 2048) for k in (32, 2048)],
        "overhead_s": {"per_layer_step": 1e-3, "per_microbatch": 0.0, "per_step": 2e-3},
        "collectives": {"intra_node": coll, "inter_node": coll}}))
    cluster = plan_accuracy.cluster_of(str(profile))
    assert len(plan_accuracy.LAYOUTS) >= 8
    seen = set()
    for label, overrides in plan_accuracy.LAYOUTS.items():
        seconds = plan_accuracy.predicted_step_s([*plan_accuracy.MODEL, *overrides], cluster)  # validate()s
        assert seconds > 0, label
        from megand.training.config import compose

        c = candidate_of(compose([*plan_accuracy.MODEL, *overrides]), plan_accuracy.WORLD)
        seen.add((c.tp, c.pp, c.vpp, c.cp, c.dp, c.sequence_parallel, c.sharding, c.recompute, c.micro_batch_size))
    assert len(seen) == len(plan_accuracy.LAYOUTS)  # no two labels run the same layout
    top = plan_accuracy.top_plan(cluster, plan_accuracy.MODEL)
    assert any(o.startswith("parallel.tp=") for o in top)


def test_hetero_improvement_ratio():
    plan_hetero = load("plan_hetero")
    figures = plan_hetero.improvement({"even": 2.0, "uneven": 1.5}, {"even": [3.0, 2.0, 2.2], "uneven": [1.7, 1.8, 9.0]})
    assert figures["predicted_gain"] == pytest.approx(0.25)
    assert figures["measured_gain"] == pytest.approx(1 - 1.8 / 2.2)  # medians of the rounds
    assert figures["ratio"] == pytest.approx((1 - 1.8 / 2.2) / 0.25)
    same = plan_hetero.improvement({"even": 2.0, "uneven": 2.0}, {"even": [2.0], "uneven": [2.0]})
    assert same["ratio"] != same["ratio"]  # nan: no gain predicted (the planner kept the even split)


def test_shares_benchmark_plans_uneven_shares_that_run(tmp_path):
    """benchmarks/plan_shares.py's plan on two synthetic profiles (one a third as fast): the fast replica
    takes more micro-batches, and both layouts it measures pass validate()."""
    from megand.training.config import compose, validate

    plan_shares = load("plan_shares")
    coll = {op: {"alpha_s": 1e-4, "gbps": 1.0} for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p", "all_to_all")}
    paths = {}
    for name, peak in (("fast", 0.1), ("slow", 0.1 / 3)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps({
            "name": name, "peak_tflops": peak, "memory_gbps": 20.0 * peak / 0.1,
            "gemm": [{"m": m, "n": n, "k": k, "tflops": peak} for m in (32, 2048) for n in (32, 2048) for k in (32, 2048)],
            "overhead_s": {"per_layer_step": 1e-3, "per_microbatch": 0.0, "per_step": 2e-3},
            "collectives": {"intra_node": coll, "inter_node": coll}}))
    best = plan_shares.plan(plan_shares.cluster_of({k: str(v) for k, v in paths.items()}))
    shares = dict(zip((g.name for g in best.replica_groups), best.shares))
    assert shares["fast"] > shares["slow"] and best.prediction.step_time_s < best.even_step_s
    overrides = [*plan_shares.MODEL, *best.overrides()]
    validate(compose(overrides), 2)
    validate(compose([*overrides, "parallel.dp_microbatches=null"]), 2)
