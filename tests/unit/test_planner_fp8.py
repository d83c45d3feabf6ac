"""The planner under ``train.fp8``: the FP8 layers' GEMMs at the profile's FP8 peak (first and last layers
in bf16), ZeRO-3 gathering their weights in FP8, MFU against the mixed peak, and the search using it."""

import pytest

from megand.models.flops import Shape, flops_per_iteration, fp8_flops_fraction
from megand.tools.plan import pinned_keys
from megand.tools.planner.cluster import parse_cluster
from megand.tools.planner.cost import fp8_layers_in, layer_times, predict
from megand.tools.planner.defaults import DEVICES
from megand.tools.planner.layout import Candidate
from megand.tools.planner.search import Planner, config_validator
from megand.training.config import compose
from megand.training.peak import mixed_peak

H100 = {"groups": [{"name": "h100", "nodes": 1, "devices_per_node": 8, "device": "h100"}]}
MODEL = {"num_layers": 16, "hidden_size": 2048, "ffn_hidden_size": 5632, "num_attention_heads": 16,
         "num_query_groups": 8, "seq_length": 4096, "vocab_size": 32000, "activation": "swiglu",
         "position_embedding": "rope"}


def test_fp8_layers_per_stage_keep_the_first_and_last_in_bf16():
    c = Candidate.of(fp8="tensorwise", fp8_bf16_layers=1)
    assert fp8_layers_in(16, c, 0, 16) == 14
    assert [fp8_layers_in(16, c, 4 * s, 4) for s in range(4)] == [3, 4, 4, 3]
    assert fp8_layers_in(16, Candidate.of(), 0, 16) == 0
    assert fp8_layers_in(16, Candidate.of(fp8="mxfp8", fp8_bf16_layers=0), 0, 16) == 16


def test_fp8_gemms_run_at_the_fp8_peak():
    profile = DEVICES["h100"]["profile"]
    assert profile.peak_fp8_tflops == pytest.approx(2 * profile.peak_tflops, rel=0.01)
    shape, c = Shape.from_config(MODEL), Candidate.of(micro_batch_size=2)
    bf16 = layer_times(shape, c, profile, "intra_node", "intra_node")
    fp8 = layer_times(shape, c, profile, "intra_node", "intra_node", fp8=True)
    assert fp8.gemm_fwd == pytest.approx(bf16.gemm_fwd * profile.peak_tflops / profile.peak_fp8_tflops)
    assert fp8.attn_fwd == bf16.attn_fwd  # the attention core stays in bf16


def test_fp8_step_is_faster_and_its_mfu_counts_the_mixed_peak():
    group = parse_cluster(H100).groups[0]
    c = Candidate.of(dp=8, micro_batch_size=1, sharding="optim_grads_params")
    bf16 = predict(MODEL, c, 64, [group])
    fp8 = predict(MODEL, c.with_(fp8="tensorwise"), 64, [group])
    assert fp8.step_time_s < 0.9 * bf16.step_time_s
    fraction = fp8_flops_fraction(MODEL, 14, 1)
    peak = mixed_peak(group.profile.peak_tflops, group.profile.peak_fp8_tflops, fraction) * 8e12
    assert fp8.mfu == pytest.approx(flops_per_iteration(MODEL, 64, "none")["model_flops"] / fp8.step_time_s / peak)
    # ZeRO-3: rowwise gathers FP8 for forward only, tensorwise both ways: no slower than rowwise
    rowwise = predict(MODEL, c.with_(fp8="rowwise"), 64, [group])
    assert fp8.step_time_s <= rowwise.step_time_s < bf16.step_time_s


def test_the_search_plans_fp8_runs_at_the_fp8_peak():
    def best(extra):
        overrides = ["model=llama_1b", "model.seq_length=2048", "train.global_batch_size=64", *extra]
        cfg = compose(overrides)
        return Planner(cfg, pinned_keys(overrides), parse_cluster(H100), validate_fn=config_validator(cfg)).plan(1)[0]

    bf16, fp8 = best([]), best(["train.fp8=tensorwise"])
    assert fp8.candidate.fp8 == "tensorwise" and bf16.candidate.fp8 is None
    assert fp8.prediction.tokens_per_s > 1.2 * bf16.prediction.tokens_per_s
    assert "train.fp8=tensorwise" not in fp8.overrides()  # the user's own key, not a searched one
