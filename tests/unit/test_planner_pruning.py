"""The planner's pruning and caches never change the answer: with every lower bound at zero (nothing pruned,
every candidate timed) and the stage times computed afresh for each question, the search returns the same
best plans, on homogeneous and heterogeneous clusters (stages of different widths, replicas of different
speeds, devices so small that recomputation is forced)."""

import pytest

from megand.tools.plan import pinned_keys
from megand.tools.planner import hetero, search
from megand.tools.planner.cluster import parse_cluster
from megand.tools.planner.cost import StageTimes, stage_times
from megand.tools.planner.search import Planner, config_validator
from megand.training.config import compose

SMALL = ["+experiment=tiny_llama", "model.num_layers=6", "model.hidden_size=256", "model.ffn_hidden_size=704",
         "model.seq_length=256", "train.global_batch_size=16"]


def _group(name, nodes, per_node, device, **numbers):
    return {"name": name, "nodes": nodes, "devices_per_node": per_node, "device": device, **numbers}


CLUSTERS = {
    "one_group": [_group("h100", 1, 4, "h100")],
    "two_types": [_group("h200", 1, 4, "h200"), _group("h100", 1, 2, "h100")],  # nodes of different sizes
    "two_speeds": [_group("h100", 1, 2, "h100"), _group("a100", 1, 2, "a100")],
    # devices of a few tens of MiB: most layouts fit only by recomputing some layers (the bound counts it)
    "tight": [_group("h200", 1, 4, "h200", memory_gib=0.03), _group("h100", 1, 2, "h100", memory_gib=0.02)],
}


def _plans(cluster, top=3):
    """The best plans of the whole search and, on several groups, of the pipelines across them alone."""
    cfg = compose(SMALL)
    planner = Planner(cfg, pinned_keys(SMALL), parse_cluster({"groups": cluster}), validate_fn=config_validator(cfg))
    plans = planner.plan(top) + (planner.plan_heterogeneous(top) if len(cluster) > 1 else [])
    return [(p.prediction.step_time_s, p.overrides()) for p in plans]


def _exhaustive(m):
    """Every bound (next to) zero: nothing can be pruned; the stage times not memoised."""
    m.setattr(Planner, "compute_bound", lambda self, c, groups, fill=True: 1e-30)
    m.setattr(StageTimes, "lower_bound", lambda self, pp: 0.0)
    m.setattr(hetero, "split_bound", lambda planner, c, groups: 0.0)
    m.setattr(hetero, "recompute_bound", lambda planner, c, groups: 0.0)
    m.setattr(Planner, "times", lambda self, c, groups: stage_times(self.model, c, self.gbs, groups))
    m.setattr(search, "_ceiling", lambda plans, top: float("inf"))  # each phase's whole top, not only what enters


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in ("two_types", "tight") else [pytest.mark.slow])
                                  for n in sorted(CLUSTERS)])  # two_types: stages of different widths, replicas
def test_pruned_search_returns_the_exhaustive_best(name, monkeypatch):
    pruned = _plans(CLUSTERS[name])
    with monkeypatch.context() as m:
        _exhaustive(m)
        exhaustive = _plans(CLUSTERS[name])
    assert [t for t, _ in pruned] == pytest.approx([t for t, _ in exhaustive], rel=1e-12)
    assert pruned[0][1] == exhaustive[0][1] and pruned[3:4] == exhaustive[3:4]


def test_the_split_bound_is_below_every_split():
    """split_bound is a lower bound: never above the predicted step of the plans the search times."""
    cfg = compose(SMALL)
    planner = Planner(cfg, pinned_keys(SMALL), parse_cluster({"groups": CLUSTERS["two_types"]}),
                      validate_fn=config_validator(cfg))
    plans = planner.plan_heterogeneous(top=20)
    assert plans
    for p in plans:
        assert hetero.split_bound(planner, p.candidate, p.stage_groups) <= p.prediction.step_time_s


@pytest.mark.parametrize("case", [pytest.param(0, id="tight")] + [pytest.param(i, marks=pytest.mark.slow) for i in range(1, 6)])
def test_the_recompute_bound_is_below_every_split(case, monkeypatch):
    """recompute_bound is a lower bound on every split the exhaustive search times of a candidate (its own
    sharding, schedule and memory), however much recomputation the memory forces: random small cases."""
    import random

    rng = random.Random(case)
    layers = 6 if case == 0 else rng.choice([4, 5, 6, 8])
    small = [o for o in SMALL if not o.startswith("model.num_layers")] + [f"model.num_layers={layers}"]
    mem = 0.025 if case == 0 else rng.uniform(0.012, 0.06)
    cluster = [_group("h200", 1, 4, "h200", memory_gib=mem * rng.uniform(1.0, 2.0) if case else mem * 1.2),
               _group("h100", 1, rng.choice([2, 4]) if case else 2, "h100", memory_gib=mem)]
    cfg = compose(small)
    with monkeypatch.context() as m:
        _exhaustive(m)
        planner = Planner(cfg, pinned_keys(small), parse_cluster({"groups": cluster}), validate_fn=None)
        plans = planner.plan_heterogeneous(top=10_000)
    assert sum(p.candidate.recompute != "none" for p in plans) > 0  # the memory forces recomputation somewhere
    for p in plans:
        split = p.candidate.with_(recompute="none", recompute_layers=None, pipeline_layout=None)  # as expanded
        assert hetero.recompute_bound(planner, split, p.stage_groups) <= p.prediction.step_time_s, p.overrides()


def test_the_fill_bound_is_below_every_replayed_pipeline():
    """StageTimes.lower_bound (the busiest rank's compute after the pipeline's fill) never exceeds the replay."""
    import random

    from megand.core.pipeline_parallel.registry import schedule_error, schedule_names
    from megand.tools.planner.layout import Candidate
    from megand.tools.planner.cost import rank_virtual_stages
    from megand.tools.planner.simulate import simulate

    rng = random.Random(0)
    for schedule in schedule_names():
        for pp, vpp, m in ((2, None, 4), (4, None, 8), (4, 2, 8), (3, 2, 6)):
            if schedule_error(schedule, pp, vpp, m) is not None:
                continue
            c = Candidate.of(pp=pp, vpp=vpp, pp_schedule=schedule)
            n = pp * (vpp or 1)
            f = [rng.uniform(0.5, 2) for _ in range(n)]
            b = [rng.uniform(1, 4) for _ in range(n)]
            times = StageTimes(forward=f, backward=b, p2p=[0.1] * (n - 1), microbatches=m, links={}, placement=None,
                               weight_grad=[x / 2 for x in b], rank_stages=rank_virtual_stages(c))
            replay = simulate(pp, vpp, m, f, b, [0.1] * (n - 1), schedule=schedule, weight_grad=[x / 2 for x in b])
            assert times.busiest() <= times.lower_bound(pp) <= max(replay.finish) + 1e-12, (schedule, pp, vpp)
