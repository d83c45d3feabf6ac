"""The planner's per-replica batch shares (shares.py): water-filling is optimal (against brute force), the
search gives a faster group's replicas more micro-batches in plans the training config accepts, the time
budget returns the best plans so far, and the estimator's answers are cached."""

import itertools
import random

import pytest

from megand.tools.plan import pinned_keys
from megand.tools.planner.cluster import parse_cluster
from megand.tools.planner.search import Planner, config_validator
from megand.tools.planner.shares import place_replicas, plan_shares, replicas_on, water_fill
from megand.training.config import compose, validate

SMALL = ["+experiment=tiny_llama", "model.num_layers=8", "model.hidden_size=256", "model.ffn_hidden_size=704",
         "model.seq_length=128", "train.global_batch_size=16"]


def _two_speeds(slow_peak, devices_per_node=1):
    prof = {"nodes": 1, "devices_per_node": devices_per_node, "device": "cpu", "memory_gib": 8}
    return parse_cluster({"groups": [{"name": "fast", **prof}, {"name": "slow", **prof, "peak_tflops": slow_peak}]})


def _brute_force(times, total, minimum, multiple):
    best = None
    for shares in itertools.product(range(1, total + 1), repeat=len(times)):
        if sum(shares) != total or any(k < minimum or k % multiple for k in shares):
            continue
        slowest = max(t(k) for t, k in zip(times, shares))
        best = slowest if best is None else min(best, slowest)
    return best


def _affine(a, b, jump):
    return lambda k: a + b * k + (3.0 if jump and k > 4 else 0.0)  # nondecreasing, not always affine


def test_water_filling_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        n, total = rng.randint(1, 3), rng.randint(1, 12)
        minimum, multiple = rng.randint(1, 3), rng.choice([1, 1, 2, 3])
        times = [_affine(rng.uniform(0, 2), rng.uniform(0.1, 3), rng.random() < 0.3) for _ in range(n)]
        got, want = water_fill(times, total, minimum, multiple), _brute_force(times, total, minimum, multiple)
        if want is None:
            assert got is None
            continue
        shares, slowest = got
        assert sum(shares) == total and all(k >= minimum and k % multiple == 0 for k in shares)
        assert slowest == max(t(k) for t, k in zip(times, shares))
        assert slowest <= want * (1 + 1e-12)


def test_water_filling_gives_a_faster_replica_more_and_calls_each_time_once():
    calls = []

    def timed(rate):
        def t(k):
            calls.append((rate, k))
            return k / rate
        return t

    shares, slowest = water_fill([timed(3.0), timed(1.0)], 8)
    assert shares == (6, 2) and slowest == 2.0
    assert len(calls) == len(set(calls))  # memoised per replica and share
    assert water_fill([timed(1.0)] * 3, 2) is None  # fewer micro-batches than replicas
    assert water_fill([timed(1.0)] * 2, 7, multiple=2) is None  # no multiples of 2 sum to 7


def test_replicas_sit_on_whole_nodes_with_consecutive_ranks():
    cluster = parse_cluster({"groups": [{"name": "a", "nodes": 2, "devices_per_node": 4, "device": "cpu"},
                                        {"name": "b", "nodes": 1, "devices_per_node": 4, "device": "cpu"}]})
    a, b = cluster.groups
    assert replicas_on(a, 2, 1) == 4 and replicas_on(a, 2, 2) == 2 and replicas_on(a, 8, 1) == 1
    assert replicas_on(a, 3, 1) == 0  # three ranks per stage never fill whole 4-device nodes
    from megand.tools.planner.layout import Candidate

    c = Candidate.of(tp=2, pp=2, dp=3)  # replicas 0, 1 on a (one node per stage), replica 2 on b
    placement = place_replicas(c, (a, a, b))
    assert placement is None  # b's single node would hold ranks of both stages, not consecutive
    c = Candidate.of(tp=4, pp=1, dp=3)
    placement = place_replicas(c, (a, a, b))
    assert placement.nodes == (("a", 0), ("a", 1), ("b", 0))


def test_search_gives_the_faster_group_more_micro_batches_and_beats_the_even_split():
    cfg = compose(SMALL)
    planner = Planner(cfg, pinned_keys(SMALL), _two_speeds(0.084 / 3), validate_fn=config_validator(cfg))
    alone = {g.name: planner.plan_homogeneous(g, 1)[0].prediction.tokens_per_s for g in planner.cluster.groups}
    plans = plan_shares(planner, top=2, alone=alone)
    best = plans[0]
    fast, slow = best.shares
    assert [g.name for g in best.replica_groups] == ["fast", "slow"] and fast > slow
    assert best.even_step_s > best.prediction.step_time_s  # the predicted gain over equal shares
    speedups = best.speedups()
    assert speedups["even_split"] > 1 and speedups["fastest_group_alone"] == pytest.approx(speedups["fast_alone"])
    assert f"parallel.dp_microbatches=[{fast},{slow}]" in best.overrides()
    validate(compose(SMALL + best.overrides()), best.world_size)  # what a run checks accepts it
    assert best.launch()["nodes"] == ["fast:0", "slow:0"]


def test_time_budget_returns_the_best_plan_so_far_and_says_so():
    cfg = compose(SMALL)
    planner = Planner(cfg, pinned_keys(SMALL), _two_speeds(0.084 / 3), validate_fn=config_validator(cfg),
                      time_budget_s=1e-9)
    plans = planner.plan(top=3)
    assert planner.cut and plans  # cut at once, still a plan (the first one timed)
    for p in plans:
        validate(compose(SMALL + p.overrides()), p.world_size)
    unbounded = Planner(cfg, pinned_keys(SMALL), _two_speeds(0.084 / 3), validate_fn=config_validator(cfg))
    full = unbounded.plan(top=3)
    assert not unbounded.cut
    assert full[0].prediction.step_time_s <= plans[0].prediction.step_time_s


def test_the_estimators_answers_are_cached_per_layout_and_stage(monkeypatch):
    from megand.models.flops import FrozenModel, Shape
    from megand.tools.planner import search
    from megand.tools.planner.cost import stage_memory_gib, stage_times
    from megand.tools.planner.layout import Candidate

    cfg = compose(SMALL)
    planner = Planner(cfg, pinned_keys(SMALL), _two_speeds(0.084 / 3))
    asked = []
    real = search.estimate_memory

    def counting(model, layout, stages=None):
        asked.append(tuple(stages))
        return real(model, layout, stages=stages)

    monkeypatch.setattr(search, "estimate_memory", counting)
    c = Candidate.of(pp=2, micro_batch_size=2, precision="fp32")
    whole = planner.memory(c)
    assert planner.memory(c, [1]) == whole[1:] and planner.memory(c) == whole
    assert asked == [(0, 1)]  # one estimate; the stage asked again came from the cache
    assert whole == stage_memory_gib(planner.model, c, 4)  # the cached answer is the estimator's
    planner.memory(c, [0], microbatches=1)  # another micro-batch count is another layout
    assert len(asked) == 2
    # the compute bound: one answer for a layout whatever its sharding, recompute and overlap flags, and
    # never above the bound of any of them
    group = planner.cluster.groups[0]
    variants = [c.with_(sharding=s, recompute=r) for s in ("none", "optim") for r in ("none", "full")]
    bounds = {planner.compute_bound(v, [group] * 2) for v in variants}
    assert len(bounds) == 1 and len(planner._bounds) == 1
    (bound,) = bounds
    assert all(bound <= stage_times(planner.model, v, 16, [group] * 2).lower_bound(2) * (1 + 1e-12) for v in variants)
    # the planner's model holds its shape: read, never recomputed, and never changed underneath it
    assert isinstance(planner.model, FrozenModel) and Shape.from_config(planner.model) is planner.model.shape
    with pytest.raises(TypeError):
        planner.model["num_layers"] = 2
