"""The planner's pruning never changes the answer: with every lower bound at zero (nothing pruned, every
candidate timed) the search returns the same best plans, on homogeneous and heterogeneous clusters (stages
of different widths, replicas of different speeds)."""

import pytest

from megand.tools.plan import pinned_keys
from megand.tools.planner import hetero
from megand.tools.planner.cluster import parse_cluster
from megand.tools.planner.cost import StageTimes
from megand.tools.planner.search import Planner, config_validator
from megand.training.config import compose

SMALL = ["+experiment=tiny_llama", "model.num_layers=6", "model.hidden_size=256", "model.ffn_hidden_size=704",
         "model.seq_length=256", "train.global_batch_size=16"]


def _group(name, nodes, per_node, device, **numbers):
    return {"name": name, "nodes": nodes, "devices_per_node": per_node, "device": device, **numbers}


CLUSTERS = {
    "one_group": [_group("h100", 1, 4, "h100")],
    "two_types": [_group("h200", 1, 4, "h200"), _group("h100", 1, 2, "h100")],
    "two_speeds": [_group("h100", 1, 2, "h100"), _group("a100", 1, 2, "a100")],
}


def _plans(cluster, top=3):
    cfg = compose(SMALL)
    planner = Planner(cfg, pinned_keys(SMALL), parse_cluster({"groups": cluster}), validate_fn=config_validator(cfg))
    return [(p.prediction.step_time_s, p.overrides()) for p in planner.plan(top)]


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_pruned_search_returns_the_exhaustive_best(name, monkeypatch):
    pruned = _plans(CLUSTERS[name])
    with monkeypatch.context() as m:  # every bound (next to) zero: nothing can be pruned
        m.setattr(Planner, "compute_bound", lambda self, c, groups, fill=True: 1e-30)
        m.setattr(StageTimes, "lower_bound", lambda self, pp: 0.0)
        m.setattr(hetero, "split_bound", lambda planner, c, groups: 0.0)
        exhaustive = _plans(CLUSTERS[name])
    assert [t for t, _ in pruned] == pytest.approx([t for t, _ in exhaustive], rel=1e-12)
    assert pruned[0][1] == exhaustive[0][1]


def test_the_split_bound_is_below_every_split():
    """split_bound is a lower bound: never above the predicted step of the plans the search times."""
    cfg = compose(SMALL)
    planner = Planner(cfg, pinned_keys(SMALL), parse_cluster({"groups": CLUSTERS["two_types"]}),
                      validate_fn=config_validator(cfg))
    plans = planner.plan_heterogeneous(top=20)
    assert plans
    for p in plans:
        assert hetero.split_bound(planner, p.candidate, p.stage_groups) <= p.prediction.step_time_s
