"""The memory estimator on Mixture-of-Experts models, against hand-computed values: expert weights per
rank (split over ep and etp), their states sharded over the expert-data-parallel group, the dispatch
activations, the all-to-all bytes per step, and total vs active parameters in the report."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megand.models.flops import param_counts
from megand.tools.estimate_memory import (Layout, all_to_all_bytes_per_step, estimate_memory,
                                          layer_activation_bytes, stage_expert_params, stage_layers,
                                          stage_moe_layers, stage_params)

MIXTRAL = dict(arch="llama", num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
               num_query_groups=8, seq_length=4096, vocab_size=32000, norm="rmsnorm", activation="swiglu",
               position_embedding="rope", tie_embeddings=False, hidden_dropout=0.0, attention_dropout=0.0,
               num_experts=8, moe_top_k=2)
H, F, E = 4096, 14336, 8
EXPERT = 3 * H * F                      # one SwiGLU expert: gate, up, down
ATTENTION = H * (H + 2 * 1024) + H * H  # fused QKV (8 KV groups of 128) and output projection
SMALL = dict(arch="llama", num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
             seq_length=32, vocab_size=256, norm="rmsnorm", activation="swiglu", position_embedding="rope",
             tie_embeddings=False, hidden_dropout=0.0, attention_dropout=0.0, num_experts=8, moe_top_k=2,
             moe_ffn_hidden_size=32, moe_shared_experts=1, moe_layer_freq=2)


def test_expert_weights_per_rank_split_over_ep_and_etp():
    layout = Layout.of(pp=4, dp=16, ep=8)
    assert stage_layers(32, layout, 0) == list(range(8)) and stage_moe_layers(MIXTRAL, layout, 0) == 8
    assert stage_expert_params(MIXTRAL, layout, 0) == 8 * E * EXPERT / 8      # one expert per rank and layer
    rest = 8 * (ATTENTION + E * H + 2 * H)                                      # + router, two norms
    assert stage_params(MIXTRAL, layout, 0) == rest + 8 * EXPERT + 32000 * H  # + the word embedding
    # expert tensor parallelism: etp = tp splits each expert again; etp = 1 keeps whole experts
    split = Layout.of(tp=2, pp=4, dp=8, ep=8)
    whole = Layout.of(tp=2, pp=4, dp=8, ep=8, etp=1)
    assert stage_expert_params(MIXTRAL, split, 0) == 8 * EXPERT / 2
    assert stage_expert_params(MIXTRAL, whole, 0) == 8 * EXPERT
    assert stage_params(MIXTRAL, whole, 0) - stage_params(MIXTRAL, split, 0) == 8 * EXPERT / 2
    # one rank holding everything is the full count
    assert stage_params(MIXTRAL, Layout.of(), 0) == param_counts(MIXTRAL).total


def test_expert_data_parallel_group_and_its_sharding():
    assert Layout.of(dp=16, ep=8).edp == 2
    assert Layout.of(tp=2, dp=8, ep=4).edp == 2            # etp = tp: edp = dp*cp/ep
    assert Layout.of(tp=2, dp=8, ep=4, etp=1).edp == 4     # whole experts on both tp ranks: tp*dp*cp/(ep*etp)
    assert Layout.of(dp=4, cp=2, ep=4).edp == 2
    layout = Layout.of(pp=4, dp=16, ep=8, sharding="optim", precision="bf16")
    st = estimate_memory(MIXTRAL, layout, stages=[0]).stages[0]
    experts = 8 * EXPERT
    dense = st.params - experts
    assert st.expert_params == experts
    # bf16 params 2 and fp32 grads 4 everywhere; fp32 main params + Adam (12) over dp=16 dense, over edp=2 experts
    assert st.param_bytes == pytest.approx(2 * st.params)
    assert st.grad_bytes == pytest.approx(4 * st.params)
    assert st.optimizer_bytes == pytest.approx(dense * 12 / 16 + experts * 12 / 2)
    for bad, needle in ((dict(dp=6, ep=4), "ep=4 must be a positive divisor of dp*cp = 6*1 = 6"),
                        (dict(tp=4, dp=2, etp=2), "etp=2")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            Layout.of(**bad)


def test_dispatch_activations_by_hand():
    # SMALL in bf16, micro-batch 2: T = 64 tokens, k = 2, E = 8, expert width 32, one shared expert (32)
    layout = Layout.of(micro_batch_size=2)
    T, e, h = 64, 2, 64
    dense = layer_activation_bytes(SMALL, layout)
    moe = layer_activation_bytes(SMALL, layout, moe=True)
    dense_mlp = T * 3 * e * 96
    router = T * 8 * 8                               # fp32 logits and scores
    routed = T * 2 * (2 * e * h + 3 * e * 32)        # tokens x k x (input, output) + the experts' inner activations
    shared = T * 3 * e * 32
    assert moe - (dense - dense_mlp) == router + routed + shared
    # etp = 1 at tp = 2: each tp rank routes half the tokens through whole experts
    tp_whole = Layout.of(micro_batch_size=2, tp=2, etp=1, sequence_parallel=True)
    tp_split = Layout.of(micro_batch_size=2, tp=2, sequence_parallel=True)
    base = layer_activation_bytes(SMALL, tp_split) - T * 3 * e * 96 / 2
    assert layer_activation_bytes(SMALL, tp_split, moe=True) - base == pytest.approx(
        router / 2 + T * 2 * (2 * e * h + 3 * e * 32 / 2) + shared / 2)
    assert layer_activation_bytes(SMALL, tp_whole, moe=True) - base == pytest.approx(
        router / 2 + T / 2 * 2 * (2 * e * h + 3 * e * 32) + shared / 2)
    # a capacity factor bounds the routed part at that multiple of the balanced load
    capped = layer_activation_bytes(dict(SMALL, moe_capacity_factor=1.5), layout, moe=True)
    assert capped - moe == pytest.approx(0.5 * routed)


def test_stages_count_their_own_moe_layers():
    # layers 0 and 2 are MoE (moe_layer_freq=2): with pp=2 each stage has one
    layout = Layout.of(pp=2, micro_batch_size=2, num_microbatches=4)
    est = estimate_memory(SMALL, layout)
    assert [st.moe_layers for st in est.stages] == [1, 1]
    per_layer = (layer_activation_bytes(SMALL, layout) + layer_activation_bytes(SMALL, layout, moe=True)) / 2
    assert est.stages[0].activation_bytes_per_layer == pytest.approx(per_layer)
    # interleaved: stage 0 holds chunks 0 and 2 (layers 0 and 2), both MoE; stage 1 none
    inter = Layout.of(pp=2, vpp=2, num_microbatches=4)
    assert stage_layers(4, inter, 0) == [0, 2] and stage_moe_layers(SMALL, inter, 1) == 0
    assert stage_expert_params(SMALL, inter, 0) == 2 * 8 * 3 * 64 * 32


def test_all_to_all_bytes_per_step_by_hand():
    # per MoE layer and micro-batch: each of its T*k assignments sends h*e bytes, (ep-1)/ep of them to
    # other ranks, in the dispatch and the combine, forward and backward (4 passes)
    layout = Layout.of(dp=4, ep=4, micro_batch_size=2, num_microbatches=3, precision="bf16")
    per_pass = 64 * 2 * 64 * 2 * 3 / 4
    assert all_to_all_bytes_per_step(SMALL, layout, 0) == 2 * 3 * 4 * per_pass
    assert estimate_memory(SMALL, layout).stages[0].all_to_all_bytes_per_step == 2 * 3 * 4 * per_pass
    full = Layout.of(dp=4, ep=4, micro_batch_size=2, num_microbatches=3, recompute="full")
    assert all_to_all_bytes_per_step(SMALL, full, 0) == 2 * 3 * 6 * per_pass  # the forward runs twice
    # sequence parallelism: each tp rank sends its own sequence shard; with experts split over tp
    # (etp = tp) what arrived is also exchanged with the tp-1 other tp ranks, and the outputs back
    sp_whole = Layout.of(tp=2, dp=4, ep=4, etp=1, micro_batch_size=2, num_microbatches=3, sequence_parallel=True)
    assert all_to_all_bytes_per_step(SMALL, sp_whole, 0) == 2 * 3 * 4 * per_pass / 2
    sp_split = Layout.of(tp=2, dp=4, ep=4, micro_batch_size=2, num_microbatches=3, sequence_parallel=True)
    assert all_to_all_bytes_per_step(SMALL, sp_split, 0) == 2 * 3 * 4 * (per_pass / 2 + 64 * 2 * 64 * 2 / 2)
    assert all_to_all_bytes_per_step(SMALL, Layout.of(dp=4), 0) == 0
    assert all_to_all_bytes_per_step({**SMALL, "num_experts": None}, layout, 0) == 0


def test_cli_reports_total_and_active_parameters():
    root = Path(__file__).resolve().parents[2]
    tool, env = root / "tools" / "estimate.py", {**os.environ, "PYTHONPATH": str(root)}  # this checkout's presets
    table = subprocess.run([sys.executable, str(tool), "model=mixtral_8x7b", "train.precision=bf16"],
                           capture_output=True, text=True, check=True, env=env).stdout
    assert "46.70B parameters, 12.88B active per token" in table
    assert "of which routed experts" in table and "all-to-all sent per step" in table
    out = subprocess.run([sys.executable, str(tool), "model=deepseek_v3_small", "--json"],
                         capture_output=True, text=True, check=True, env=env).stdout
    stage = json.loads(out)["memory"]["stages"][0]
    assert stage["moe_layers"] == 26 and stage["expert_params"] == 26 * 64 * 3 * 2048 * 1408  # layer 0 dense


@pytest.mark.parametrize("overrides", [
    ["parallel.etp=1", "model.moe_shared_experts=1", "model.moe_layer_freq=2"],  # whole experts, a dense layer
    ["train.precision=bf16", "optim.sharding=optim", "model.moe_shared_experts=2"],
], ids=["etp1_shared_dense_layer", "bf16_zero1_shared"])
def test_estimate_of_a_moe_rank_against_its_rehearsal(overrides, capsys):
    """A rank of a MoE layout (tp=2 + sp) built and stepped on fake tensors holds what the estimator predicts,
    with the tolerances of the dense rehearsal test (tests/unit/test_rehearse.py)."""
    from megand.tools.rehearse import main

    main(["+experiment=tiny_llama", "model=moe_tiny", "parallel.tp=2", "parallel.sequence_parallel=true", *overrides,
          "--world-size", "4", "--rank", "1", "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    peak = {name: ph["peak_bytes"] for name, ph in report["phases"].items()}
    est = report["estimate_bytes"]
    assert abs(peak["build"] / est["build"] - 1) <= 0.02, (peak, est)
    assert 1.0 <= peak["forward_backward"] / est["forward_backward"] <= 1.35, (peak, est)
    assert 1.0 <= peak["optimizer_step"] / est["optimizer_step"] <= 1.3, (peak, est)
