"""DeepSeek Sparse Attention's analytic terms: the parameter count and FLOPs of a DeepSeek-V3.2 model equal the
transformers model's (``FlopCounterMode``, its indexer counted forward only: no gradient reaches it) when the
top-k covers the sequence (transformers' masked dense attention then computes what a sparse kernel would);
a shorter top-k counts its keys; the indexer loss adds the indexer's backward and its target."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megand.models import flops
from megand.models.hf import build_hf_model

V32 = dict(arch="llama", num_layers=3, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, seq_length=32,
           vocab_size=256, norm="rmsnorm", norm_eps=1e-6, activation="swiglu", position_embedding="rope",
           tie_embeddings=False, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=16, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32, moe_shared_experts=1,
           moe_router="sigmoid", moe_first_k_dense_replace=1, dsa_index_topk=32, dsa_index_heads=4,
           dsa_index_head_dim=16)


def test_param_counts_and_flops_match_transformers():
    model = build_hf_model(V32, attn_implementation="eager", experts_implementation="eager")
    assert flops.param_counts(V32).total == sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    assert flops.flops_per_iteration(V32, global_batch_size=2)["model_flops"] == counter.get_total_flops()


def test_top_k_shorter_than_the_sequence_counts_its_keys_and_the_indexer_scores_every_key():
    s, k = 32, 8
    dense, sparse = (flops.forward_flops_per_token(dict(V32, dsa_index_topk=t)) for t in (s, k))
    per_key = 2 * 4 * (24 + 16)  # scores (query width) and context (value width)
    assert dense.attention - sparse.attention == 3 * per_key * (s - k)
    assert sparse.indexer == dense.indexer == 3 * (2 * (24 * 4 * 16 + 64 * 16 + 64 * 4) + 2 * (4 * 16 + 4) * s)


@pytest.mark.parametrize("coeff", [0.0, 0.1])
def test_indexer_loss_adds_the_indexers_backward_and_target(coeff):
    fwd = flops.forward_flops_per_token(dict(V32, dsa_indexer_loss_coeff=coeff))
    projections, scores = 2 * (24 * 4 * 16 + 64 * 16 + 64 * 4), 2 * (4 * 16 + 4) * 32
    expected = projections + scores if not coeff else 2 * projections + 3 * scores + 2 * 4 * 24 * 32
    assert fwd.indexer_step == 3 * expected
    assert flops.model_flops_per_token(dict(V32, dsa_indexer_loss_coeff=coeff)) == 3 * fwd.total + fwd.indexer_step


def test_the_indexer_loss_counts_the_chosen_keys_and_the_top_k_path_its_block_recomputation():
    """Top-k 5 of 32 keys: the top-k path. The indexer loss's backward and target count the 5 chosen keys (the
    selection still scores every key); hardware FLOPs add the blocks' recomputation in backward (the
    attention cores and the loss's chosen scores), which is selective recomputation's core; the dense mask
    (top-k 16 of 32) recomputes nothing."""
    k, s = 5, 32
    model = dict(V32, dsa_index_topk=k, dsa_indexer_loss_coeff=0.1)
    fwd = flops.forward_flops_per_token(model)
    projections, per_key = 2 * (24 * 4 * 16 + 64 * 16 + 64 * 4), 2 * (4 * 16 + 4)
    assert fwd.indexer_step == 3 * (2 * projections + per_key * s + 2 * per_key * k + 2 * 4 * 24 * k)
    loss_scores, cores = 3 * per_key * k, fwd.attention + fwd.mtp_attention
    assert (fwd.topk_core_recompute, fwd.topk_loss_recompute) == (cores, loss_scores)
    model_flops = flops.model_flops_per_token(model)
    assert flops.hardware_flops_per_token(model, "none") == model_flops + cores + loss_scores
    assert flops.hardware_flops_per_token(model, "selective") == model_flops + cores + loss_scores
    assert flops.hardware_flops_per_token(model, "selective", recomputed_layers=[1]) == model_flops + cores + loss_scores
    assert flops.hardware_flops_per_token(model, "full") == model_flops + fwd.layers_matmul + fwd.indexer + 2 * cores + loss_scores
    dense = dict(model, dsa_index_topk=16)
    assert flops.hardware_flops_per_token(dense, "none") == flops.model_flops_per_token(dense)


def test_the_estimator_counts_the_top_k_paths_indices_and_the_dense_masks_scores():
    """Per token and layer: the top-k path keeps k indices and flags (and the loss's target over them), the
    same at any length; the dense mask keeps its s-wide attention core, mask and (with the loss) the indexer's
    fp32 scores, growing with s; under cp both keep the other ranks' gathered keys and values."""
    from megand.tools.estimate_memory import Layout, layer_activation_bytes

    def dsa_term(seq, topk, coeff=0.1, **layout):
        model = dict(V32, seq_length=seq, dsa_index_topk=topk, dsa_indexer_loss_coeff=coeff)
        plain = {k: v for k, v in model.items() if not k.startswith("dsa_")}
        tokens = seq / layout.get("cp", 1)
        lay = Layout.of(precision="bf16", **layout)
        return (layer_activation_bytes(model, lay) - layer_activation_bytes(plain, lay)) / tokens

    a, w, hi, di, e = 4, 24, 4, 16, 2
    indexer = e * hi * di + 2 * e * di + 4 * hi
    for seq in (64, 256):  # top-k 8: the top-k path, less the dense core it replaces
        assert dsa_term(seq, 8) == pytest.approx(9 * 8 + 4 * 8 + indexer - a * seq * e)
    assert dsa_term(64, 8, coeff=0.0) == pytest.approx(9 * 8 - a * 64 * e)
    assert dsa_term(64, 32) == pytest.approx(64 + 4 * 64 * (hi + 3) + indexer)  # the dense mask
    assert dsa_term(64, 8, cp=2) - dsa_term(64, 8) == pytest.approx(2 * a * w * e + e * di)
