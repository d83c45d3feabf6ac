"""Gemma 3's, OLMo 3's and SmolLM3's block variants reproduce the one-process run (the parity tolerances of
tests/harness.py, per tensor): sandwich and (1 + w) norms, GeGLU, scaled embeddings, per-head q/k norms, local
layers with a RoPE base of their own and global ones with a scaled RoPE, a query scalar apart from the head width
and one key/value head (Gemma 3); norms on the branch outputs and q/k norms over the whole projections, whose
weights are split over tp with the heads and whose mean of squares is summed over tp (OLMo 3); NoPE layers
(SmolLM3). One layout per feature in the default suite; the matrix over tp+sp, pp, cp (each cp path: the local
windows), ZeRO-3 and full recompute is slow. The default suite holds these features through the transformers
checks of tests/distributed/test_hf_local_global_families.py (OLMo 3 at tp=2 x pp=2 with sp), within its budget;
these per-tensor checks all run with the slow tests."""

import pytest

from tests.harness import assert_parity

FEATURES = {
    "gemma3_like": ["model.activation=geglu", "model.norm_placement=sandwich", "model.norm_unit_offset=true",
                    "model.embedding_scale=true", "model.qk_norm=true", "model.head_dim=24",
                    "model.num_query_groups=1", "model.query_pre_attn_scalar=16", "model.rope_theta=1000000.0",
                    "model.rope_local_theta=10000.0", "model.rope_scaling={rope_type:linear,factor:2.0}",
                    "model.sliding_window=[8,8,8,null]", "model.tie_embeddings=true"],
    "olmo3_like": ["model.norm_placement=post", "model.qk_norm=true", "model.qk_norm_scope=projection",
                   "model.sliding_window=[8,8,8,null]"],
    "smollm3_like": ["model.no_rope=[false,false,false,true]"],
}
LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2": (2, ["parallel.pp=2"]),
    "cp2": (2, ["parallel.cp=2"]),
    "cp2_all_gather": (2, ["parallel.cp=2", "parallel.cp_comm=all_gather"]),
    "cp2_a2a": (2, ["parallel.cp=2", "parallel.cp_comm=a2a"]),
    "dp2_zero3": (2, ["optim.sharding=optim_grads_params"]),
    "tp2_sp_recompute_full": (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "train.recompute=full"]),
}
# first: OLMo 3's q/k norms split over tp (with sp), Gemma 3's local layers over cp (with MQA at tp=2 after)
FIRST = {"olmo3_like": "tp2_sp", "gemma3_like": "cp2"}
MATRIX = [(f, l) for f in FEATURES for l in LAYOUTS if FIRST.get(f) != l]


def _check(reference, launch, feature, layout):
    nproc, overrides = LAYOUTS[layout]
    assert_parity(reference("tiny_llama", *FEATURES[feature]),
                  launch("tiny_llama", nproc, *FEATURES[feature], *overrides))


@pytest.mark.slow
@pytest.mark.parametrize("feature, layout", FIRST.items(), ids=[f"{f}-{l}" for f, l in FIRST.items()])
def test_feature_matches_one_process(reference, launch, feature, layout):
    _check(reference, launch, feature, layout)


@pytest.mark.slow
@pytest.mark.parametrize("feature, layout", MATRIX, ids=[f"{f}-{l}" for f, l in MATRIX])
def test_feature_matrix_matches_one_process(reference, launch, feature, layout):
    _check(reference, launch, feature, layout)
