"""The memory estimator for pipeline stages of different tensor-parallel widths: each stage counted at its
own width equals the same stage of a one-width run at that width, term by term; the hand-off between widths
is added on the stages that hold it; the table names each stage's width; the planner's memory for such a
plan is the estimator's for the config the plan emits."""

import json

import pytest
from omegaconf import OmegaConf

from megand.tools import estimate
from megand.tools.estimate_memory import Layout, chunks_in_flight, estimate_memory
from megand.training.config import compose, validate

TERMS = ("params", "param_bytes", "grad_bytes", "optimizer_bytes", "gathered_bytes", "activation_bytes_per_layer",
         "layer_microbatches_in_flight", "layer_activation_bytes", "extra_activation_bytes", "recompute_working_bytes")
BASE = ["+experiment=tiny_llama", "train.precision=bf16", "train.global_batch_size=16", "train.micro_batch_size=2"]


def stages(*entries) -> str:
    """``parallel.pipeline_layout`` of per-stage entries ``(layers, tp, sp)``."""
    return "parallel.pipeline_layout=[" + ",".join(f"{{layers:{n},tp:{tp},sp:{str(sp).lower()}}}"
                                                    for n, tp, sp in entries) + "]"


def estimated(overrides, world):
    cfg = compose(BASE + list(overrides))
    validate(cfg, world)
    model = OmegaConf.to_container(cfg.model, resolve=True)
    layout = Layout.from_config(cfg.parallel, cfg.train, cfg.optim, world_size=world)
    return model, layout, estimate_memory(model, layout, range(layout.pp)).stages


# name: (per-stage layout, its world, its options), then per stage the one-width run it must equal there
CASES = {
    "tp2_tp1": ((("parallel.pp=2", stages((3, 2, False), (1, 1, False))), 3),
                [(("parallel.pp=2", "parallel.tp=2", "parallel.pipeline_layout=[3,1]"), 4),
                 (("parallel.pp=2", "parallel.pipeline_layout=[3,1]"), 2)]),
    "tp2sp_tp1_zero1_dp2": ((("parallel.pp=2", "optim.sharding=optim", stages((3, 2, True), (1, 1, False))), 6),
                            [(("parallel.pp=2", "optim.sharding=optim", "parallel.tp=2", "parallel.sequence_parallel=true",
                               "parallel.pipeline_layout=[3,1]"), 8),
                             (("parallel.pp=2", "optim.sharding=optim", "parallel.pipeline_layout=[3,1]"), 4)]),
    # interleaved: pipeline rank 0 holds virtual stages 0 and 2, every one of its hand-offs to another width
    "tp1_tp2sp_vpp2_zero3": ((("parallel.pp=2", "parallel.vpp=2", "optim.sharding=optim_grads_params",
                               "train.recompute=full",
                               stages((1, 1, False), (1, 2, True), (1, 1, False), (1, 2, True))), 3),
                             [(("parallel.pp=2", "parallel.vpp=2", "optim.sharding=optim_grads_params",
                                "train.recompute=full", "parallel.pipeline_layout=[1,1,1,1]"), 2),
                              (("parallel.pp=2", "parallel.vpp=2", "optim.sharding=optim_grads_params",
                                "train.recompute=full", "parallel.tp=2", "parallel.sequence_parallel=true",
                                "parallel.pipeline_layout=[1,1,1,1]"), 4)]),
}


@pytest.mark.parametrize("name", CASES)
def test_each_stage_equals_the_one_width_run_at_its_width(name):
    (overrides, world), alone = CASES[name]
    model, layout, mixed = estimated(overrides, world)
    assert layout.heterogeneous
    for s, (one_overrides, one_world) in enumerate(alone):
        _, one, same = estimated(one_overrides, one_world)
        st, ref = mixed[s], same[s]
        assert not one.heterogeneous and (st.tp, st.sequence_parallel) == (one.tp, one.sp)
        for term in TERMS:  # parameters, their states and shards, activations under the schedule: at its width
            assert getattr(st, term) == getattr(ref, term), (s, term)
        assert st.total_bytes == pytest.approx(ref.total_bytes + st.hand_off_bytes)


def test_hand_off_is_the_kept_outputs_and_one_gathered_message():
    """[tp2+sp, tp1] with 4 micro-batches: the first stage keeps each output it sent to the other width
    until its backward (the chunks in flight, at its sequence shard) and gathers one whole activation
    before a send; the last stage, without sequence parallelism, sends its gradients as it holds them."""
    model, layout, (first, last) = estimated(("parallel.pp=2", stages((3, 2, True), (1, 1, False))), 3)
    whole = 2 * 32 * 64 * 2  # micro-batch 2 x seq 32 x hidden 64, bf16
    assert chunks_in_flight(layout.at_stage(0), 0) == 2
    assert first.hand_off_bytes == 2 * whole / 2 + whole
    assert last.hand_off_bytes == 0
    # one width throughout: no hand-off
    _, _, same = estimated(("parallel.pp=2", "parallel.tp=2", "parallel.pipeline_layout=[3,1]"), 4)
    assert [st.hand_off_bytes for st in same] == [0, 0]


def test_estimate_tool_shows_each_stage_width(capsys):
    argv = BASE + ["parallel.pp=2", stages((3, 2, True), (1, 1, False))]
    assert estimate.main(argv) == 0
    table = capsys.readouterr().out
    assert "tp=[2, 1] (per stage)" in table and "sp=['on', 'off']" in table
    width_row = next(line for line in table.splitlines() if line.startswith("tensor-parallel width"))
    assert width_row.rstrip().endswith("tp 1") and "tp 2 + sp" in width_row
    assert "hand-off between widths" in table
    assert estimate.main(argv + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(st["tp"], st["sequence_parallel"]) for st in report["memory"]["stages"]] == [(2, True), (1, False)]
    assert report["memory"]["stages"][0]["hand_off_bytes"] > 0


def test_planner_memory_of_a_mixed_plan_is_the_estimate_of_its_config():
    """The planner counts a plan of stages of different widths with the estimator (hand-off included), on
    the layout the plan's overrides give a run."""
    from megand.models.flops import FrozenModel
    from megand.tools.planner.cost import GIB, stage_memory_gib
    from megand.tools.planner.layout import Candidate, override_value

    c = Candidate.of(tp=2, pp=2, dp=1, micro_batch_size=2, precision="bf16", fused_attention=False,
                     pipeline_layout=(3, 1)).with_(stage_widths=((2, True), (1, False)))
    settings = {k: v for k, v in c.settings().items() if v is not None}
    overrides = [f"{k}={override_value(v)}" for k, v in settings.items()]
    model, layout, mixed = estimated(overrides, c.world_size)
    planned = stage_memory_gib(FrozenModel(model), c, layout.num_microbatches)
    assert planned == pytest.approx([st.total_bytes / GIB for st in mixed], rel=1e-12)
    assert mixed[0].hand_off_bytes > 0


def test_the_search_counts_a_mixed_plan_as_the_estimator_does():
    """The search asks for each width's stages once (shared by the candidates of that width) and adds the
    hand-off: the same GiB as the estimator's answer for the whole mixed layout."""
    from megand.tools.plan import pinned_keys
    from megand.tools.planner.cluster import parse_cluster
    from megand.tools.planner.cost import stage_memory_gib
    from megand.tools.planner.layout import Candidate
    from megand.tools.planner.search import Planner
    from megand.training.config import compose

    overrides = ["+experiment=tiny_llama", "train.global_batch_size=8"]
    planner = Planner(compose(overrides), pinned_keys(overrides), parse_cluster({"groups": [
        {"name": "h100", "nodes": 1, "devices_per_node": 4, "device": "h100"}]}))
    for widths, layers in ((((2, True), (1, False)), (3, 1)), (((1, False), (2, True), (2, True)), (1, 2, 1))):
        c = Candidate.of(tp=2, pp=len(widths), dp=1, micro_batch_size=2, precision="bf16", fused_attention=False,
                         pipeline_layout=layers).with_(stage_widths=widths)
        m = c.parallel.microbatches(8, 2)
        assert planner.memory(c) == pytest.approx(stage_memory_gib(planner.model, c, m), rel=1e-12)
