"""The open-model features reproduce the one-process run (the parity tolerances of tests/harness.py):
RoPE scaling (llama3, yarn, linear), a head width apart from hidden/heads, q/k/v biases and per-head q/k
RMSNorm (whose replicated weights see only the rank's own heads: their gradients are summed over tp by the
rule declared where they are made, with or without sequence parallelism). One layout per feature in the
default suite; the matrix over tp+sp, pp, cp and ZeRO-3 is slow."""

import pytest

from tests.harness import assert_parity

LLAMA3_SCALING = "model.rope_scaling={rope_type:llama3,factor:8.0,low_freq_factor:1.0,high_freq_factor:4.0," \
                 "original_max_position_embeddings:8}"
FEATURES = {
    "rope_llama3": [LLAMA3_SCALING],
    "rope_yarn": ["model.rope_scaling={rope_type:yarn,factor:4.0,original_max_position_embeddings:8}"],
    "rope_linear": ["model.rope_scaling={rope_type:linear,factor:2.0}"],
    "head_dim": ["model.head_dim=24"],
    "qk_norm": ["model.qk_norm=true"],
    # Qwen3-like: all at once (a head width of its own, q/k norms, q/k/v biases, scaled RoPE)
    "qwen3_like": ["model.head_dim=24", "model.qk_norm=true", "model.qkv_bias=true", LLAMA3_SCALING],
}
LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2": (2, ["parallel.pp=2"]),
    "cp2": (2, ["parallel.cp=2"]),
    "dp2_zero3": (2, ["optim.sharding=optim_grads_params"]),
}
# the default suite: each feature once, where it could go wrong
DEFAULT = {"rope_llama3": "tp2_sp", "head_dim": "pp2", "qk_norm": "tp2", "qwen3_like": "cp2"}


def _check(reference, launch, feature, layout):
    nproc, overrides = LAYOUTS[layout]
    assert_parity(reference("tiny_llama", *FEATURES[feature]),
                  launch("tiny_llama", nproc, *FEATURES[feature], *overrides))


@pytest.mark.parametrize("feature, layout", DEFAULT.items(), ids=[f"{f}-{l}" for f, l in DEFAULT.items()])
def test_feature_matches_one_process(reference, launch, feature, layout):
    _check(reference, launch, feature, layout)


MATRIX = [(f, l) for f in FEATURES for l in LAYOUTS if DEFAULT.get(f) != l]


@pytest.mark.slow
@pytest.mark.parametrize("feature, layout", MATRIX, ids=[f"{f}-{l}" for f, l in MATRIX])
def test_feature_matrix_matches_one_process(reference, launch, feature, layout):
    _check(reference, launch, feature, layout)
