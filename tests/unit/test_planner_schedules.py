"""The planner searches the pipeline schedule: each candidate is replayed on its own schedule's action list
and counted with its own activations in flight; a zero-bubble schedule wins when the bubble dominates and
memory allows it, 1F1B stays when memory does not; the plans compose and validate as training would; a
heterogeneous V plan counts each rank on the two chunks it holds; unknown schedules are one line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megand.core.pipeline_parallel.actions import placement_for
from megand.tools.plan import pinned_keys
from megand.tools.planner.cluster import parse_cluster
from megand.tools.planner.cost import memory_layout, predict, stage_times
from megand.tools.planner.hetero import plan_heterogeneous
from megand.tools.planner.search import PlanError, Planner, config_validator, predict_config
from megand.tools.planner.simulate import simulate
from megand.tools.estimate_memory import estimate_memory, stage_layers
from megand.training.config import compose, validate

ROOT = Path(__file__).resolve().parents[2]
# a pipeline of 2 stages with 4 micro-batches: 1F1B idles (p-1)/(m+p-1) = 20% of the step
PINNED = ["+experiment=tiny_llama", "train.global_batch_size=4", "train.micro_batch_size=1", "parallel.tp=1",
          "parallel.cp=1", "parallel.pp=2", "train.recompute=none", "optim.sharding=none"]
GPU = {"name": "h100", "nodes": 1, "devices_per_node": 2, "device": "h100"}
# the 8B model on two H100s at 4 micro-batches: compute, not fixed costs, sets the step
BIG = ["model=llama_8b", "model.seq_length=4096", "train.global_batch_size=8", "train.micro_batch_size=1",
       "parallel.tp=1", "parallel.cp=1", "parallel.pp=2", "parallel.vpp=null", "train.recompute=none",
       "optim.sharding=none"]


def _planner(overrides, cluster, **kwargs):
    cfg = compose(overrides)
    return Planner(cfg, pinned_keys(overrides), parse_cluster(cluster), validate_fn=config_validator(cfg), **kwargs)


def _trains(overrides, plan):
    """The plan's overrides after the user's, composed and validated as pretrain_gpt.py does."""
    cfg = compose(list(overrides) + plan.overrides())
    validate(cfg, plan.world_size)
    return cfg


def test_predicted_step_replays_the_candidates_own_schedule():
    planner = _planner(BIG, {"groups": [{**GPU, "memory_gib": 1000}]})
    base = planner.plan(1)[0].candidate
    groups = [planner.cluster.groups[0]] * 2
    makespans = {}
    for schedule, vpp in (("1f1b", None), ("zb1p", None), ("1f1b", 2), ("zbv", 2), ("dualpipev", 2)):
        c = base.with_(pp_schedule=schedule, vpp=vpp, pipeline_layout=None)
        times = stage_times(planner.model, c, planner.gbs, groups)
        pred = predict(planner.model, c, planner.gbs, groups, times=times)
        replay = simulate(2, vpp, times.microbatches, times.forward, times.backward, times.p2p, schedule=schedule,
                          weight_grad=times.weight_grad)
        assert pred.parts["pipeline_s"] == replay.makespan and pred.bubble_fraction == replay.bubble_fraction
        assert pred.mem_peak_gib == [s.total_bytes / 2 ** 30 for s in estimate_memory(
            planner.model, memory_layout(c, times.microbatches), stages=range(2)).stages]
        makespans[(schedule, vpp)] = replay.makespan
    # W fills the bubble: zero bubble beats 1F1B, the V beats both
    assert makespans[("zbv", 2)] < makespans[("zb1p", None)] < makespans[("1f1b", None)]


def test_search_takes_zero_bubble_when_the_bubble_dominates():
    cpu = {"groups": [{"name": "cpu", "nodes": 1, "devices_per_node": 2, "device": "cpu"}]}
    plans = _planner(PINNED, cpu).plan(3)
    assert plans[0].candidate.pp_schedule in ("zb1p", "zbv", "dualpipev")
    for p in plans:
        cfg = _trains(PINNED, p)
        assert cfg.parallel.pp_schedule == p.candidate.pp_schedule
    # one chunk per rank (vpp pinned off): zb1p wins, and its overrides name it
    gpu = _planner(PINNED + ["parallel.vpp=null"], {"groups": [GPU]})
    best = gpu.plan(1)[0]
    assert best.candidate.pp_schedule == "zb1p" and "parallel.pp_schedule=zb1p" in best.overrides()
    _trains(PINNED + ["parallel.vpp=null"], best)


def test_1f1b_stays_where_zero_bubbles_memory_does_not_fit():
    planner = _planner(BIG, {"groups": [{**GPU, "memory_gib": 1000}]})
    c = planner.plan(1)[0].candidate
    peak = {s: max(planner.memory(c.with_(pp_schedule=s))) for s in ("1f1b", "zb1p")}
    assert peak["zb1p"] > peak["1f1b"]  # W passes keep their operands alive past the input gradient
    between = (peak["1f1b"] + peak["zb1p"]) / 2
    roomy = _planner(BIG, {"groups": [{**GPU, "memory_gib": peak["zb1p"] + 1}]}).plan(1)[0]
    tight = _planner(BIG, {"groups": [{**GPU, "memory_gib": between}]}).plan(1)[0]
    assert roomy.candidate.pp_schedule == "zb1p" and tight.candidate.pp_schedule == "1f1b"
    assert max(tight.prediction.mem_peak_gib) <= between
    assert "parallel.pp_schedule=1f1b" in tight.overrides()  # written: a preset's schedule would stay otherwise
    _trains(BIG, tight)


def test_a_given_runs_prediction_replays_its_schedule():
    cluster = parse_cluster({"groups": [{**GPU, "memory_gib": 1000}]})
    one, zero = (predict_config(compose(BIG + [f"parallel.pp_schedule={s}"]), cluster, 2) for s in ("1f1b", "zb1p"))
    assert zero.parts["pipeline_s"] < one.parts["pipeline_s"] and zero.bubble_fraction < one.bubble_fraction


def test_validator_trial_keeps_no_schedule_of_an_earlier_candidate():
    cfg = compose(PINNED)
    check = config_validator(cfg)
    planner = _planner(PINNED, {"groups": [{"name": "cpu", "nodes": 1, "devices_per_node": 2, "device": "cpu"}]})
    c = planner.plan(1)[0].candidate
    assert check(c.with_(pp_schedule="zbv", vpp=2, pipeline_layout=None)) is None
    assert check(c.with_(pp_schedule="1f1b", vpp=None, pipeline_layout=None)) is None


def test_heterogeneous_v_plan_counts_each_rank_on_its_two_chunks():
    overrides = ["+experiment=tiny_llama", "model.num_layers=8", "train.global_batch_size=8",
                 "train.micro_batch_size=1", "parallel.tp=1", "parallel.cp=1"]
    prof = {"nodes": 1, "devices_per_node": 1, "device": "cpu", "memory_gib": 8}
    cluster = {"groups": [{"name": "fast", **prof}, {"name": "slow", **prof, "peak_tflops": 0.084 / 3}]}
    planner = _planner(overrides, cluster, schedules=("zbv",))
    best = plan_heterogeneous(planner, 1)[0]
    c = best.candidate
    assert (c.pp_schedule, c.vpp, len(c.pipeline_layout)) == ("zbv", 2, 4)
    _trains(overrides, best)
    # rank r holds virtual stages r and 3 - r: its layers, memory and times are those of its own group
    layout = memory_layout(c, 8)
    assert stage_layers(8, layout, 0) == list(range(c.pipeline_layout[0])) + list(
        range(8 - c.pipeline_layout[3], 8))
    groups = list(best.stage_groups)
    times = stage_times(planner.model, c, 8, groups)
    where = placement_for(2, 2, "zbv").location
    for g in groups:
        alone = stage_times(planner.model, c, 8, [g, g])
        for s in range(4):
            if groups[where(s)[0]].name == g.name:
                assert times.forward[s] == pytest.approx(alone.forward[s])
                assert times.backward[s] == pytest.approx(alone.backward[s])
    # the fast group's rank takes more layers over its two chunks
    assert c.pipeline_layout[0] + c.pipeline_layout[3] > c.pipeline_layout[1] + c.pipeline_layout[2]


def test_unknown_schedules_are_one_line():
    with pytest.raises(PlanError, match="unknown pipeline schedule"):
        _planner(PINNED, {"groups": [GPU]}, schedules=("zbx",))
    with pytest.raises(PlanError, match="unknown pipeline schedule"):
        _planner(PINNED, {"groups": [GPU]}, schedules=())
    cluster = ROOT / "examples" / "cluster_two_types.yaml"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "plan.py"), "+experiment=tiny_llama", "--cluster",
                        str(cluster), "--schedules", "1f1b,zbx"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "zbx" in r.stderr and "dualpipev" in r.stderr
