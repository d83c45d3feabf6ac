"""The planner's search: plans pass validate() and fit, pins hold, impossible requests say why, and a
slower group gets fewer layers."""

import pytest

from megand.tools.plan import pinned_keys
from megand.tools.planner.cluster import parse_cluster
from megand.tools.planner.search import PlanError, Planner, config_validator
from megand.training.config import compose, validate

CPU2 = {"groups": [{"name": "cpu", "nodes": 1, "devices_per_node": 2, "device": "cpu"}]}
TINY = ["+experiment=tiny_llama", "train.global_batch_size=8"]


def _plan(overrides, cluster, top=5):
    cfg = compose(overrides)
    planner = Planner(cfg, pinned_keys(overrides), parse_cluster(cluster), validate_fn=config_validator(cfg))
    return planner.plan(top)


def _check_as_training_would(overrides, plan):
    """The plan's overrides appended to the user's, composed and validated exactly as pretrain_gpt.py does."""
    cfg = compose(list(overrides) + plan.overrides())
    validate(cfg, plan.world_size)
    return cfg


def test_every_plan_passes_validate_and_fits():
    plans = _plan(TINY, CPU2)
    assert len(plans) == 5
    times = [p.prediction.step_time_s for p in plans]
    assert times == sorted(times)
    for p in plans:
        _check_as_training_would(TINY, p)
        assert p.world_size <= 2
        assert all(m <= cap for m, cap in zip(p.prediction.mem_peak_gib, p.prediction.memory_gib))


@pytest.mark.slow
def test_gpu_plans_pass_validate_and_fit():
    overrides = ["model=llama_8b", "model.seq_length=4096", "train.global_batch_size=64"]
    cluster = {"groups": [{"name": "h100", "nodes": 2, "devices_per_node": 8, "device": "h100"}]}
    plans = _plan(overrides, cluster, top=3)
    for p in plans:
        cfg = _check_as_training_would(overrides, p)
        assert cfg.train.precision == "bf16"  # not pinned: the devices' precision
        assert max(p.prediction.mem_peak_gib) <= 80
        assert 0.2 < p.prediction.mfu < 0.75


def test_pinned_overrides_stay_fixed():
    overrides = TINY + ["parallel.pp=2", "train.recompute=full", "train.micro_batch_size=1"]
    for p in _plan(overrides, CPU2):
        cfg = _check_as_training_would(overrides, p)
        assert (cfg.parallel.pp, cfg.train.recompute, cfg.train.micro_batch_size) == (2, "full", 1)


def test_a_fully_pinned_layout_is_predicted_as_given():
    overrides = TINY + ["parallel.tp=2", "parallel.pp=1", "parallel.cp=1", "parallel.dp=1",
                        "parallel.sequence_parallel=false", "train.micro_batch_size=4", "train.recompute=none",
                        "optim.sharding=none"]
    (plan,) = _plan(overrides, CPU2, top=1)
    c = plan.candidate
    assert (c.tp, c.pp, c.dp, c.sequence_parallel, c.micro_batch_size) == (2, 1, 1, False, 4)


def test_impossible_request_says_how_many_devices_it_needs():
    cluster = {"groups": [{"name": "a100", "nodes": 1, "devices_per_node": 8, "device": "a100-40gb"}]}
    with pytest.raises(PlanError, match=r"the smallest layout that fits needs (\d+) devices of 40 GiB") as e:
        _plan(["model=llama_70b", "train.global_batch_size=64", "model.seq_length=4096"], cluster)
    assert int(e.value.args[0].split("needs ")[1].split()[0]) > 8


def test_impossible_pinned_layout_says_why():
    with pytest.raises(PlanError, match="parallel.tp=3"):
        _plan(TINY + ["parallel.tp=3"], CPU2)


def _two_speeds(slow_peak):
    prof = {"nodes": 1, "devices_per_node": 1, "device": "cpu", "memory_gib": 8}
    return {"groups": [{"name": "fast", **prof}, {"name": "slow", **prof, "peak_tflops": slow_peak}]}


def test_heterogeneous_search_gives_the_slower_group_fewer_layers():
    overrides = ["+experiment=tiny_llama", "model.num_layers=8", "model.hidden_size=256", "model.ffn_hidden_size=704",
                 "model.seq_length=128", "train.global_batch_size=16"]
    cfg = compose(overrides)
    planner = Planner(cfg, pinned_keys(overrides), parse_cluster(_two_speeds(0.084 / 3)),
                      validate_fn=config_validator(cfg))
    hetero = planner.plan_heterogeneous(top=3)
    best = hetero[0]
    assert [g.name for g in best.stage_groups] == ["fast", "slow"]
    from megand.tools.planner.cost import rank_virtual_stages

    # per rank, over the chunks it holds (a V schedule, searched on CPUs, gives each rank two)
    fast_layers, slow_layers = (sum(best.candidate.pipeline_layout[s] for s in stages)
                                for stages in rank_virtual_stages(best.candidate))
    assert fast_layers > slow_layers
    _check_as_training_would(overrides, best)
    # the balanced split beats the even one on the same two groups
    from megand.tools.planner.cost import predict

    even = predict(planner.model, best.candidate.with_(pipeline_layout=None), 16, best.stage_groups)
    assert best.prediction.step_time_s < even.step_time_s
    # and the full search reports its speed-up over each group's best homogeneous plan
    plans = planner.plan(top=10)
    assert any(p.hetero_ratio is not None and p.hetero_ratio > 0 for p in plans)
