"""FLOPs and parameter counts from the shape, checked against transformers reference models."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megand.models import flops

LLAMA = dict(arch="llama", num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
             num_query_groups=2, seq_length=32, vocab_size=256, norm="rmsnorm", activation="swiglu",
             position_embedding="rope", rope_theta=10000.0, tie_embeddings=False, init_std=0.02,
             hidden_dropout=0.0, attention_dropout=0.0)
GPT = dict(arch="gpt", num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
           num_query_groups=4, seq_length=32, vocab_size=256, norm="layernorm", activation="gelu",
           position_embedding="learned", tie_embeddings=True, init_std=0.02,
           hidden_dropout=0.0, attention_dropout=0.0)


def _hf_model(cfg):
    from megand.models.hf import build_hf_model
    # eager attention: its matmuls are visible to FlopCounterMode (CPU sdpa kernels are not counted)
    return build_hf_model(cfg, attn_implementation="eager")


@pytest.mark.parametrize("cfg", [LLAMA, GPT], ids=["llama", "gpt"])
def test_param_count_matches_transformers(cfg):
    model = _hf_model(cfg)
    assert flops.param_counts(cfg).total == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("cfg", [LLAMA, GPT], ids=["llama", "gpt"])
def test_model_flops_match_flop_counter(cfg):
    model = _hf_model(cfg)
    batch = 2
    ids = torch.randint(0, cfg["vocab_size"], (batch, cfg["seq_length"]))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    measured = counter.get_total_flops()
    predicted = flops.flops_per_iteration(cfg, global_batch_size=batch)["model_flops"]
    # the acceptance bound is 5%; with these conventions the count is exact for both reference models
    assert abs(predicted - measured) / measured < 0.01, (predicted, measured)
    # attention matmuls were seen: dropping the attention term from the prediction breaks the match
    attention = 3 * batch * cfg["seq_length"] * cfg["num_layers"] * 4 * cfg["seq_length"] * cfg["hidden_size"]
    assert abs(predicted - attention - measured) / measured > 0.05


def test_hand_computed_llama_numbers():
    fwd = flops.forward_flops_per_token(LLAMA)
    h, f, s, kv = 64, 96, 32, 2 * 16
    assert fwd.layer_dense == 2 * h * (h + 2 * kv) + 2 * h * h + 6 * h * f
    assert fwd.layer_attention == 4 * s * h
    assert fwd.logits == 2 * h * 256
    assert flops.model_flops_per_token(LLAMA) == 3 * fwd.total


def test_design_note_reference_figure():
    # 6N + 12·L·h·s (+ logits 6hV) with N = non-embedding matmul weights: a bias-free, norm-free count
    p = flops.param_counts(LLAMA)
    n_matmul = p.non_embedding - LLAMA["num_layers"] * 2 * 64 - 64  # drop RMSNorm weights
    expected = 6 * n_matmul + 12 * 2 * 64 * 32 + 6 * 64 * 256
    assert flops.model_flops_per_token(LLAMA) == expected


def test_recompute_adds_hardware_flops():
    fwd = flops.forward_flops_per_token(LLAMA)
    none = flops.hardware_flops_per_token(LLAMA, "none")
    assert none == flops.model_flops_per_token(LLAMA)
    assert flops.hardware_flops_per_token(LLAMA, "selective") == none + 2 * fwd.layer_attention
    assert flops.hardware_flops_per_token(LLAMA, "full") == none + fwd.total - fwd.logits
    with pytest.raises(ValueError):
        flops.hardware_flops_per_token(LLAMA, "sometimes")


def test_logits_count_the_padded_vocabulary():
    cfg = dict(LLAMA, vocab_size=250)  # padded to a multiple of 128 x tp
    assert flops.forward_flops_per_token(cfg).logits == 2 * 64 * 250  # an unpadded model (transformers)
    assert flops.forward_flops_per_token(cfg, tp=1).logits == 2 * 64 * 256
    assert flops.forward_flops_per_token(cfg, tp=4).logits == 2 * 64 * 512
    assert flops.forward_flops_per_token(dict(cfg, make_vocab_size_divisible_by=12), tp=2).logits == 2 * 64 * 264
    assert flops.flops_per_iteration(cfg, 1, tp=4)["model_flops"] == 32 * flops.model_flops_per_token(cfg, tp=4)
    assert flops.param_counts(cfg).output_layer == 250 * 64  # parameter counts are the real ones
