"""Pipeline stages of different tensor-parallel widths: the per-stage ``parallel.pipeline_layout`` read into
the layout, the rank grid built from it (pure), the hand-off's pairs, and bad combinations refused in one
line naming the values before any work."""

import itertools

import pytest

from megand.core.parallel_layout import LayoutError, ParallelLayout
from megand.core.parallel_state import rank_groups, tp_run_groups
from megand.core.pipeline_parallel.hand_off import StageHandOff
from megand.core.pipeline_parallel.layout import pipeline_layout
from megand.training.config import ConfigError, compose, validate


def stage(layers, tp=None, sp=None):
    return {"layers": layers, **({} if tp is None else {"tp": tp}), **({} if sp is None else {"sp": sp})}


def layout(world, entries, **keys):
    return ParallelLayout.from_keys({"pp": len(entries) // (keys.get("vpp") or 1), **keys,
                                     "pipeline_layout": entries}, world)


def test_per_stage_entries_give_each_pipeline_rank_its_width():
    lay = layout(6, [stage(3, 2, True), stage(1, 1)])
    assert (lay.stage_tp, lay.stage_sp, lay.dp, lay.world_size, lay.model_ranks) == ((2, 1), (True, False), 2, 6, 3)
    assert lay.heterogeneous and [lay.stage_offset(s) for s in range(3)] == [0, 4, 6]
    assert [lay.stage_of(r) for r in range(6)] == [0, 0, 0, 0, 1, 1]
    assert lay.for_stage(1).tp == 1 and not lay.for_stage(1).heterogeneous
    assert pipeline_layout(4, 2, None, [stage(3, 2, True), stage(1, 1)]) == [3, 1]
    # tp and sp default to parallel.tp and parallel.sequence_parallel; sp over one rank is none
    lay = layout(3, [stage(2), stage(2, 1)], tp=2, sequence_parallel=True)
    assert (lay.stage_tp, lay.stage_sp) == ((2, 1), (True, False))
    # one width: the plain grid (its sequence parallelism kept per stage)
    lay = layout(4, [stage(2, 2, True), stage(2, 2, True)])
    assert not lay.heterogeneous and lay.tp == 2 and lay.stage_sp == (True, True)
    # interleaved: one entry per virtual stage, the virtual stages of a rank at its width
    lay = layout(3, [stage(1, 2, True), stage(1, 1), stage(1, 2, True), stage(1, 1)], vpp=2)
    assert (lay.stage_tp, lay.pp) == ((2, 1), 2)
    assert ParallelLayout.world_of({"pp": 2, "cp": 2, "pipeline_layout": [stage(2, 2), stage(2, 1)]}) == 6
    assert lay.sequence_multiple(False) == 2


@pytest.mark.parametrize("keys, world, message", [
    (dict(pp=2, pipeline_layout=[stage(2, 2), 2]), 3, r"either layers per stage \(integers\) or one"),
    (dict(pp=2, pipeline_layout=[stage(2, 2), {"layers": 2, "width": 1}]), 3, r"keys are layers, tp, sp"),
    (dict(pp=2, pipeline_layout=[stage(2, 2), {"tp": 1}]), 3, r"\(layers required\)"),
    (dict(pp=2, pipeline_layout=[stage(2, 2)]), 3, r"has 1 entries; parallel.pp\*vpp = 2\*1 = 2"),
    (dict(pp=2, vpp=2, pipeline_layout=[stage(1, 2), stage(1, 1), stage(1, 1), stage(1, 1)]), 3,
     r"virtual stages of pipeline rank 0 ask for different \(tp, sp\) \[\(1, False\), \(2, False\)\]"),
    (dict(pp=2, order="pp-tp-cp-dp", pipeline_layout=[stage(2, 2), stage(2, 1)]), 3, r"order='pp-tp-cp-dp'.*pp slowest"),
    (dict(pp=2, ep=2, pipeline_layout=[stage(2, 2), stage(2, 1)]), 6, r"parallel.ep=2.*not supported"),
    (dict(pp=2, pipeline_layout=[stage(2, 2), stage(2, 1)]), 4,
     r"world size 4 is not divisible by \(stage widths 2\+1\)\*cp = \(2\+1\)\*1 = 3"),
    (dict(pp=2, dp=2, pipeline_layout=[stage(2, 2), stage(2, 1)]), 3, r"parallel.dp=2 but world size 3"),
    (dict(pp=2, pipeline_layout=[stage(2, 0), stage(2, 1)]), 2, r"tp of stage 0=0 must be a positive integer"),
])
def test_bad_stage_widths_are_refused_naming_the_values(keys, world, message):
    with pytest.raises(LayoutError, match=message):
        ParallelLayout.from_keys(keys, world)


@pytest.mark.parametrize("widths, cp, dp", [((2, 1), 1, 1), ((1, 2), 1, 2), ((2, 1, 4), 2, 1), ((4, 2), 1, 2)])
def test_rank_grid_of_stage_widths(widths, cp, dp):
    """Stages are consecutive runs of ranks (pp slowest) with their own grids; every kind is a partition
    of the ranks (the embedding pairs where the first and last widths agree); tp groups are a stage's."""
    lay = ParallelLayout(pp=len(widths), cp=cp, dp=dp, stage_tp=widths)
    world = lay.world_size
    assert world == sum(widths) * cp * dp
    groups = rank_groups(lay)
    coords = [lay.coords(r) for r in range(world)]
    for kind, lists in groups.items():
        flat = sorted(itertools.chain(*lists))
        assert flat == sorted(set(flat)), kind  # no rank twice
        if kind != "embedding":
            assert flat == list(range(world)), kind
    for g in groups["tp"]:
        assert len(g) == widths[coords[g[0]]["pp"]] and [coords[r]["tp"] for r in g] == list(range(len(g)))
    for g in groups["dp_cp"]:
        assert len(g) == cp * dp and len({coords[r]["pp"] for r in g}) == 1
    for g in groups["pp"]:  # one (dp, cp) coordinate over every stage
        assert len(g) == sum(widths) and len({(coords[r]["dp"], coords[r]["cp"]) for r in g}) == 1
    assert groups["mp"] == groups["pp"]
    assert ("embedding" in groups) == (widths[0] == widths[-1])
    runs = tp_run_groups(groups["tp"])
    assert all(len(run) == int(kind[6:]) for kind, lists in runs.items() for run in lists)


@pytest.mark.parametrize("widths, sp", [((2, 1), (False, False)), ((1, 2), (False, True)), ((2, 4, 1), (True, True, False))])
def test_hand_off_pairs_each_receiver_with_one_sender(widths, sp):
    """Between any two stages: a rank's source is the one whose targets include it, of its (dp, cp)."""
    lay = ParallelLayout(pp=len(widths), dp=2, stage_tp=widths, stage_sp=sp)
    hand = [StageHandOff(lay, r) for r in range(lay.world_size)]
    for sender, receiver in itertools.product(range(lay.world_size), repeat=2):
        s, t = lay.stage_of(sender), lay.stage_of(receiver)
        if s == t:
            continue
        serves = receiver in hand[sender].targets(t)
        assert serves == (hand[receiver].source(s) == sender), (sender, receiver)
        assert not serves or lay.coords(sender)["dp"] == lay.coords(receiver)["dp"]
    for h in hand:  # every rank receives from exactly one rank of every other stage
        assert all(lay.stage_of(h.source(s)) == s for s in range(lay.pp))


def _check(*overrides, world):
    validate(compose(["+experiment=tiny_llama", "parallel.pp=2", *overrides]), world)


@pytest.mark.parametrize("overrides, world, message", [
    (("parallel.pipeline_layout=[{layers:2,tp:3},{layers:2,tp:1}]",), 4,
     r"model.num_attention_heads=4 is not divisible by the stage width tp=3 of parallel.pipeline_layout \(stage widths \[3, 1\]\)"),
    (("parallel.pipeline_layout=[{layers:2,tp:2},{layers:2,tp:1}]", "model.tie_embeddings=true"), 3,
     r"model.tie_embeddings with first and last stage widths tp=2 and tp=1"),
    (("parallel.pipeline_layout=[{layers:2,tp:2,sp:true},{layers:2,tp:1}]", "model.seq_length=33"), 3,
     r"model.seq_length=33 is not divisible by 2"),
    (("parallel.pipeline_layout=[{layers:2,tp:2},{layers:1,tp:1}]",), 3, r"summing to model.num_layers=4"),
])
def test_config_refuses_what_stage_widths_cannot_run(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        _check(*overrides, world=world)


def test_config_accepts_stage_widths():
    _check("parallel.pipeline_layout=[{layers:3,tp:2,sp:true},{layers:1,tp:1}]", world=3)
    _check("parallel.pipeline_layout=[3,1]", world=2)  # the list of integers still reads
