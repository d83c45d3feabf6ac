"""Multi-head latent attention (DeepSeek-V2/V3) reproduces the one-process run (the parity tolerances of
tests/harness.py). Its down projections and latent norms are replicated over tp: without sequence
parallelism their gradients are whole on every rank (the up projections sum the latent's gradient), under
it each rank's is partial (its sequence shard) and summed by the rule declared where they are made; the
shared rotary key's gradient is summed over tp on its way back. Value heads narrower than query/key heads
(zero-padded for the kernels) and DeepSeek's yarn attention temperature are on. One layout in the default
suite (tp2 + sp); the matrix over tp, pp (+vpp), the three cp paths, ZeRO-3, recompute and ep is slow."""

import pytest

from tests.harness import assert_parity, read_metrics, run_pretrain

YARN = "model.rope_scaling={rope_type:yarn,factor:4.0,original_max_position_embeddings:8,mscale:1.0,mscale_all_dim:1.0}"
MLA = ["model.num_query_groups=null", "model.q_lora_rank=24", "model.kv_lora_rank=16", "model.qk_nope_head_dim=12",
       "model.qk_rope_head_dim=8", "model.v_head_dim=10", YARN]
FEATURES = {"mla": MLA, "mla_no_q_lora": [*MLA, "model.q_lora_rank=null"]}
LAYOUTS = {
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "tp2": (2, ["parallel.tp=2"]),
    "tp2_sp_selective": (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "train.recompute=selective"]),
    "pp2": (2, ["parallel.pp=2"]),
    "pp2_vpp2_full": (2, ["parallel.pp=2", "parallel.vpp=2", "train.recompute=full"]),
    "cp2": (2, ["parallel.cp=2"]),
    "cp2_all_gather": (2, ["parallel.cp=2", "parallel.cp_comm=all_gather"]),
    "cp2_a2a": (2, ["parallel.cp=2", "parallel.cp_comm=a2a"]),
    "dp2_zero3": (2, ["optim.sharding=optim_grads_params"]),
}
DEFAULT = [("mla", "tp2_sp")]
MATRIX = [(f, l) for f in FEATURES for l in LAYOUTS
          if (f, l) not in DEFAULT and (f == "mla" or l in ("tp2_sp", "tp2", "cp2"))]


def _check(reference, launch, feature, layout):
    nproc, overrides = LAYOUTS[layout]
    assert_parity(reference("tiny_llama", *FEATURES[feature]),
                  launch("tiny_llama", nproc, *FEATURES[feature], *overrides))


@pytest.mark.parametrize("feature, layout", DEFAULT, ids=[f"{f}-{l}" for f, l in DEFAULT])
def test_latent_attention_matches_one_process(reference, launch, feature, layout):
    _check(reference, launch, feature, layout)


@pytest.mark.slow
@pytest.mark.parametrize("feature, layout", MATRIX, ids=[f"{f}-{l}" for f, l in MATRIX])
def test_latent_attention_matrix_matches_one_process(reference, launch, feature, layout):
    _check(reference, launch, feature, layout)


# DeepSeek-V3 in small: latent attention, a dense first layer, then MoE layers with the sigmoid router,
# group-limited top-k, the routed scaling factor and a shared expert. Every rank runs one micro-batch per
# step and the reference the global batch as one (the balancing losses are over each micro-batch's tokens).
DEEPSEEK = [*MLA, "model=moe_tiny", "model.moe_router=sigmoid", "model.moe_n_group=2", "model.moe_topk_group=1",
            "model.moe_routed_scaling_factor=2.5", "model.moe_shared_experts=1", "model.moe_first_k_dense_replace=1",
            "train.global_batch_size=4"]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["parallel.tp=2", "parallel.sequence_parallel=true"]], ids=["dp2", "tp2_sp"])
def test_deepseek_v3_like_ep2_matches_one_process(reference, tmp_path, extra):
    nproc = 2 * (2 if extra else 1)
    ref = reference("tiny_llama", *DEEPSEEK, "train.micro_batch_size=4")
    run_pretrain(tmp_path, ["+experiment=tiny_llama", *DEEPSEEK, "train.micro_batch_size=2", "parallel.ep=2", *extra],
                 nproc=nproc)
    assert_parity(ref, read_metrics(tmp_path))


from tests.distributed.test_model_features_parity import short_docs  # noqa: E402,F401  (the fixture)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["cp2", "cp2_a2a", "tp2_sp"])
def test_latent_attention_with_documents_matches_one_process(reference, launch, short_docs, layout):
    """Attention within documents (several per sample) and per-document positions on the latent heads."""
    nproc, overrides = LAYOUTS[layout]
    assert_parity(reference("tiny_llama", *MLA, *short_docs), launch("tiny_llama", nproc, *MLA, *short_docs, *overrides))
