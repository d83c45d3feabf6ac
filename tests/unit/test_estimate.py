"""Memory estimator formulas against hand-computed values (Korthikanti et al. 2022, Megatron)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megand.tools.estimate_memory import (Layout, estimate_memory, layer_activation_bytes,
                             layer_microbatches_in_flight, stage_params, state_bytes_per_param)
from megand.models.flops import param_counts

# the paper's setting: GPT shape, f = 4h, MHA, dropout everywhere, 16-bit activations
GPT = dict(arch="gpt", num_layers=24, hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=16,
           num_query_groups=16, seq_length=2048, vocab_size=50304, norm="layernorm", activation="gelu",
           position_embedding="learned", tie_embeddings=True, hidden_dropout=0.1, attention_dropout=0.1)
LLAMA = dict(arch="llama", num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
             num_query_groups=2, seq_length=32, vocab_size=256, norm="rmsnorm", activation="swiglu",
             position_embedding="rope", tie_embeddings=False, hidden_dropout=0.0, attention_dropout=0.0)

S, B, H, A = 2048, 2, 1024, 16
SBH = S * B * H
ATT = 5 * A * S / H  # 160


@pytest.mark.parametrize("tp,sp,recompute,expected", [
    (1, False, "none", SBH * (34 + ATT)),
    (4, True, "none", SBH * (34 + ATT) / 4),
    (4, False, "none", SBH * (10 + 24 / 4 + ATT / 4)),
    (4, True, "selective", SBH * 34 / 4),
    (4, False, "selective", SBH * (10 + 24 / 4)),
    (4, True, "full", 2 * SBH / 4),
    (1, False, "full", 2 * SBH),
])
def test_korthikanti_table(tp, sp, recompute, expected):
    layout = Layout.of(tp=tp, sequence_parallel=sp, recompute=recompute, micro_batch_size=B, precision="bf16")
    assert layer_activation_bytes(GPT, layout) == pytest.approx(expected)


def test_swiglu_gqa_no_dropout_by_hand():
    # per token: replicated 4·2·64 = 512; split 2·(64+32) + 2·32 + 2·64 + 3·2·96 = 960; core 4·32·2 = 256
    assert layer_activation_bytes(LLAMA, Layout.of()) == 32 * (512 + 960 + 256)
    # fp32 doubles every term (no 1-byte masks without dropout); context parallelism halves tokens
    assert layer_activation_bytes(LLAMA, Layout.of(precision="fp32")) == 2 * 32 * (512 + 960 + 256)
    assert layer_activation_bytes(LLAMA, Layout.of(cp=2)) == 16 * (512 + 960 + 256)


def test_fused_attention_keeps_no_probabilities():
    fused = layer_activation_bytes(LLAMA, Layout.of(fused_attention=True))
    assert fused == 32 * (512 + 960 + 4 * 4)
    assert layer_activation_bytes(LLAMA, Layout.of(fused_attention=True, recompute="selective")) == 32 * (512 + 960)


def test_state_bytes():
    assert sum(state_bytes_per_param(Layout.of(precision="bf16")).values()) == 18
    assert sum(state_bytes_per_param(Layout.of(precision="fp32")).values()) == 16
    assert sum(state_bytes_per_param(Layout.of(precision="bf16", distributed_optimizer=True, dp=4)).values()) == 6 + 3
    assert sum(state_bytes_per_param(Layout.of(precision="fp32", distributed_optimizer=True, dp=4)).values()) == 8 + 2
    # sharded over the whole gradient-reduction group dp·cp
    assert state_bytes_per_param(Layout.of(distributed_optimizer=True, dp=2, cp=2))["optimizer"] == 3


def test_microbatches_in_flight():
    assert layer_microbatches_in_flight(8, Layout.of(pp=1, num_microbatches=16), 0) == 8
    assert layer_microbatches_in_flight(8, Layout.of(pp=4, num_microbatches=8), 0) == 8   # pp micro-batches × L/pp
    assert layer_microbatches_in_flight(8, Layout.of(pp=4, num_microbatches=8), 3) == 2   # last stage: one
    assert layer_microbatches_in_flight(8, Layout.of(pp=4, num_microbatches=2), 0) == 4   # fewer than pp
    # interleaved: Megatron's (1 + (pp-1)/(pp·v)) factor on stage 0
    assert layer_microbatches_in_flight(8, Layout.of(pp=4, vpp=2, num_microbatches=8), 0) == 8 * (1 + 3 / 8)


def test_interleaved_with_as_many_microbatches_as_stages_holds_every_chunk():
    # m == pp: interleaving runs every forward before any backward, so every stage holds all m·v chunks
    # (the warm-up formula said 2·(pp-r-1) + (v-1)·pp + 1, i.e. 5 of 8 chunks on the last stage)
    layout = Layout.of(pp=4, vpp=2, num_microbatches=4)
    assert [layer_microbatches_in_flight(8, layout, r) for r in range(4)] == [8, 8, 8, 8]


def test_stage_params_by_hand():
    # layer per tp rank: (qkv 64·128 + proj 64·64 + gate/up 2·64·96 + down 96·64)/2 + norms 2·64 = 15488
    layout = Layout.of(tp=2, pp=2)
    assert stage_params(LLAMA, layout, 0) == 15488 + 256 * 64 / 2
    assert stage_params(LLAMA, layout, 1) == 15488 + 64 + 256 * 64 / 2
    # the padded vocabulary is what is allocated: 250 -> 256 rows at tp=2 (a multiple of 128 x 2)
    assert stage_params(dict(LLAMA, vocab_size=250), layout, 0) == 15488 + 256 * 64 / 2
    # one rank holding everything is the full count, tied (GPT) and untied (LLaMA)
    for cfg in (LLAMA, GPT):
        assert stage_params(cfg, Layout.of(), 0) == param_counts(cfg).total


def test_estimate_totals_and_peak():
    layout = Layout.of(tp=2, pp=2, dp=2, distributed_optimizer=True, micro_batch_size=B, num_microbatches=4)
    est = estimate_memory(GPT, layout)
    assert [st.stage for st in est.stages] == [0, 1]
    first = est.stages[0]
    assert first.optimizer_bytes == pytest.approx(first.params * 12 / 2)
    assert first.layer_microbatches_in_flight == 24  # 2 micro-batches × 12 layers
    parts = (first.param_bytes + first.grad_bytes + first.optimizer_bytes + first.layer_activation_bytes
             + first.extra_activation_bytes + first.recompute_working_bytes)
    assert first.total_bytes == pytest.approx(parts)
    assert est.peak.total_bytes == max(st.total_bytes for st in est.stages)
    # last stage carries fp32 logits: 4·V/tp bytes per token of one micro-batch
    assert est.stages[1].extra_activation_bytes >= 4 * 50304 / 2 * S * B
    json.dumps(est.as_dict())


def test_full_recompute_working_set():
    est = estimate_memory(GPT, Layout.of(recompute="full", micro_batch_size=B))
    assert est.stages[0].recompute_working_bytes == pytest.approx(SBH * (34 + ATT))


def test_layout_from_config():
    layout = Layout.from_config({"tp": 2, "pp": 2, "vpp": None, "cp": 1, "dp": None, "sequence_parallel": True},
                                {"micro_batch_size": 2, "global_batch_size": 32, "precision": "bf16",
                                 "recompute": "selective"}, {"sharding": "optim"}, world_size=16)
    assert layout.dp == 4 and layout.num_microbatches == 4 and layout.sp and layout.level == "optim"


def test_cli_json_and_table():
    tool = Path(__file__).resolve().parents[2] / "tools" / "estimate.py"
    out = subprocess.run([sys.executable, str(tool), "model=llama_8b", "parallel.tp=8", "parallel.sequence_parallel=true",
                          "train.recompute=selective", "train.precision=bf16", "--world-size", "64", "--json"],
                         capture_output=True, text=True, check=True).stdout
    data = json.loads(out)
    assert data["layout"]["tp"] == 8 and data["layout"]["dp"] == 8 and data["layout"]["sequence_parallel"]
    assert data["model"]["hidden_size"] == 4096 and data["memory"]["peak_total_bytes"] > 0
    table = subprocess.run([sys.executable, str(tool), "model=gpt2_125m", "model.num_layers=6", "parallel.pp=2"],
                           capture_output=True, text=True, check=True).stdout
    assert "total" in table and "stage 1" in table
    bad = subprocess.run([sys.executable, str(tool), "model=llama_8b", "parallel.tp=3"], capture_output=True, text=True)
    assert bad.returncode != 0 and "parallel.tp=3" in bad.stderr


def test_model_presets_are_complete():
    """Every conf/model preset composes and estimates (the tools read the training config)."""
    from omegaconf import OmegaConf

    from megand.training.config import compose
    presets = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "model").glob("*.yaml"))
    assert {"gpt2_125m", "llama_50m", "llama_8b", "llama_70b"} <= set(presets)
    for name in presets:
        model = OmegaConf.to_container(compose([f"model={name}"]).model, resolve=True)
        assert estimate_memory(model, Layout.of()).peak.total_bytes > 0


def test_states_match_measured_tensors_of_a_reference_model():
    """fp32, one rank: params + grads + AdamW states of a transformers LLaMA equal the prediction."""
    import torch

    from megand.models.hf import build_hf_model
    model = build_hf_model(LLAMA, attn_implementation="eager")
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, LLAMA["vocab_size"], (1, LLAMA["seq_length"]))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    measured = sum(p.nbytes + p.grad.nbytes for p in model.parameters())
    measured += sum(t.nbytes for state in optimizer.state.values() for t in state.values()
                    if isinstance(t, torch.Tensor))
    st = estimate_memory(LLAMA, Layout.of(precision="fp32")).stages[0]
    predicted = st.param_bytes + st.grad_bytes + st.optimizer_bytes
    assert abs(predicted - measured) / measured < 0.01, (predicted, measured)


def test_sharding_levels_and_hsdp_bytes_per_param():
    def total(**kw):
        return sum(state_bytes_per_param(Layout.of(precision="bf16", dp=4, **kw)).values())

    assert total(sharding="none") == 18
    assert total(sharding="optim") == 6 + 12 / 4
    assert total(sharding="optim_grads") == 2 + 16 / 4
    assert total(sharding="optim_grads_params") == 18 / 4
    assert total(sharding="optim_grads_params", dp_shard=2) == 18 / 2  # HSDP: sharded over the shard group only
    assert sum(state_bytes_per_param(Layout.of(precision="fp32", dp=2, cp=2, sharding="optim_grads_params")).values()) == 4
    layout = Layout.from_config({"dp": 8, "dp_shard": 4}, {"precision": "bf16"}, {"sharding": "optim_grads"})
    assert (layout.level, layout.shards) == ("optim_grads", 4)
    with pytest.raises(ValueError, match="sharding must be"):
        Layout.of(sharding="zero3")


def test_zero3_gathered_buckets_count_in_the_estimate():
    model = {**LLAMA, "num_layers": 4}
    kept = estimate_memory(model, Layout.of(dp=4, sharding="optim_grads_params", reshard_after_forward=False)).peak
    resharded = estimate_memory(model, Layout.of(dp=4, sharding="optim_grads_params", bucket_size=1000)).peak
    assert kept.gathered_bytes == kept.params * 2 + min(2 * 40_000_000, kept.params) * 4
    assert resharded.gathered_bytes == 2 * 1000 * 2 + 2 * 1000 * 4
    assert resharded.total_bytes < kept.total_bytes


def test_uneven_pipeline_layout_counts_each_stages_own_layers():
    from megand.models.flops import Shape, layer_params

    per_layer = layer_params(Shape.from_config(GPT)).total
    even = Layout.of(pp=2, num_microbatches=8)
    uneven = Layout.from_config({"pp": 2, "pipeline_layout": [18, 6]}, {"micro_batch_size": 1, "global_batch_size": 8},
                                {}, world_size=2)
    assert stage_params(GPT, uneven, 1) == stage_params(GPT, even, 1) - 6 * per_layer
    assert layer_microbatches_in_flight(24, uneven, 0) == 2 * 18  # 1F1B: pp - r = 2 micro-batches of 18 layers
    first_even, first_uneven = (estimate_memory(GPT, lay).stages[0].total_bytes for lay in (even, uneven))
    assert first_uneven > first_even


def test_mtp_depths_on_the_last_stage_by_hand():
    """Each depth adds a layer (15488 per tp rank), its projection 2·64·64/2 and three norms 3·64 on the last
    stage, plus (untied, pp > 1) the word embedding's copy there; one rank holds the full count."""
    mtp = dict(LLAMA, mtp_layers=2)
    layout = Layout.of(tp=2, pp=2)
    assert stage_params(mtp, layout, 0) == stage_params(LLAMA, layout, 0)
    assert stage_params(mtp, layout, 1) == stage_params(LLAMA, layout, 1) + 2 * (15488 + 4096 + 192) + 256 * 64 / 2
    assert stage_params(mtp, Layout.of(), 0) == param_counts(mtp).total
    assert (estimate_memory(mtp, layout).stages[1].extra_activation_bytes
            > estimate_memory(LLAMA, layout).stages[1].extra_activation_bytes)


@pytest.mark.parametrize("model_name", ["tiny_llama", "moe_tiny"])
def test_zero3_fp8_gathered_weights_count_one_byte(model_name):
    """train.fp8=tensorwise: ZeRO-3 gathers the FP8 layers' weights at one byte per element (the estimate
    counted two). The estimator's FP8 weights are the engine's (the model built with FP8: its layers whose
    weights ZeRO-3 gathers in FP8), and with every bucket kept gathered the held bytes are exact."""
    from megand.core.checkpointing.offline import single_process_topology
    from megand.core.distributed.data_parallel import fp8_weights
    from megand.tools.estimate_memory import stage_fp8_gathered_params
    from megand.training.config import compose
    from megand.training.core_configs import core_configs
    from megand.training.pretrain import build_model

    overrides = ["+experiment=tiny_llama", "train.precision=bf16", "train.fp8=tensorwise",
                 "optim.sharding=optim_grads_params", "optim.reshard_after_forward=false"]
    if model_name == "moe_tiny":
        overrides.append("model=moe_tiny")
    cfg = compose(overrides)
    topo = single_process_topology()
    chunks = build_model(core_configs(cfg, topo.device, topo.world_size), topo, device=torch.device("meta"))
    engine_fp8 = sum(p.numel() for p in fp8_weights(chunks))
    model = dict(cfg.model)
    layout = Layout.from_config({**dict(cfg.parallel), "dp": 2}, dict(cfg.train), dict(cfg.optim))
    assert engine_fp8 > 0 and stage_fp8_gathered_params(model, layout, 0) == engine_fp8
    fp8 = estimate_memory(model, layout).peak
    bf16 = estimate_memory(model, Layout.from_config({**dict(cfg.parallel), "dp": 2},
                                                     {**dict(cfg.train), "fp8": None}, dict(cfg.optim))).peak
    assert bf16.gathered_bytes - fp8.gathered_bytes == engine_fp8  # one byte less per FP8 element
    rowwise = estimate_memory(model, Layout.from_config({**dict(cfg.parallel), "dp": 2},
                                                        {**dict(cfg.train), "fp8": "rowwise"}, dict(cfg.optim))).peak
    assert rowwise.gathered_bytes == bf16.gathered_bytes  # backward gathers the bf16 weight
