"""The planner's per-stage recompute: each rank recomputes only the fewest of its layers that fit its
memory; the plans it gives train as they are (validate()), and on the two-type example of docs/layout.md
(examples/cluster_two_types.yaml) it is at least as fast as the search with one recompute for every layer."""

import importlib.util
import os

from megand.tools.plan import pinned_keys
from megand.tools.planner.cluster import parse_cluster
from megand.tools.planner.cost import predict
from megand.tools.planner.search import Planner, config_validator
from megand.training.config import compose, validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_type_example_is_at_least_as_fast_with_per_stage_recompute():
    bench = _load("plan_recompute")
    figures = bench.speedups(bench.DEFAULT, os.path.join(ROOT, "examples", "cluster_two_types.yaml"))
    uniform, per_stage = figures["uniform"], figures["per_stage"]
    assert per_stage["tokens_per_s"] >= uniform["tokens_per_s"] > 0
    for name, tokens in uniform["homogeneous_tokens_per_s"].items():
        assert per_stage["homogeneous_tokens_per_s"][name] >= tokens
    # the H100 nodes alone must recompute: with per-stage counts the later stage recomputes fewer layers
    h100 = per_stage["homogeneous_plans"]["h100"].candidate
    assert h100.recompute_layers is not None and per_stage["homogeneous_tokens_per_s"]["h100"] > \
        uniform["homogeneous_tokens_per_s"]["h100"]
    for f in figures.values():
        assert f["ratio"] == f["tokens_per_s"] / sum(f["homogeneous_tokens_per_s"].values())


def test_per_stage_plans_fit_validate_and_recompute_less_where_memory_allows():
    overrides = ["model=llama_70b", "model.seq_length=8192", "train.global_batch_size=64", "parallel.tp=8",
                 "parallel.sequence_parallel=true", "parallel.cp=1", "parallel.pp=2", "parallel.vpp=null",
                 "train.micro_batch_size=1", "train.recompute=full"]
    cluster = parse_cluster({"groups": [{"name": "h100", "nodes": 2, "devices_per_node": 8, "device": "h100"}]})
    cfg = compose(overrides)
    planner = Planner(cfg, pinned_keys(overrides), cluster, validate_fn=config_validator(cfg))
    best = planner.plan(1)[0]
    c = best.candidate
    # 1F1B: the first stage holds two micro-batches in flight, the last one: it recomputes fewer layers
    assert c.recompute_layers is not None and c.recompute_layers[1] < c.recompute_layers[0] <= 40
    assert all(m <= cap for m, cap in zip(best.prediction.mem_peak_gib, best.prediction.memory_gib))
    validate(compose(overrides + best.overrides()), best.world_size)
    # one fewer recomputed layer on the first stage no longer fits; every layer recomputing is slower
    tighter = c.with_(recompute_layers=(c.recompute_layers[0] - 1, c.recompute_layers[1]))
    assert not planner.fits(tighter, list(best.stage_groups))
    uniform = predict(planner.model, c.with_(recompute_layers=None), 64, list(best.stage_groups))
    assert best.prediction.step_time_s < uniform.step_time_s
