"""Gemma 4 with all its pieces in one model, as the small Gemma 4s combine them: per-layer input embeddings and
key/value sharing (the last two layers reading earlier layers' keys and values, with their MLP twice as wide),
the full layers with a head width and one key/value head of their own and keys as values, and a MoE block
beside the MLP. Written by transformers' own ``save_pretrained`` and imported: greedy generation and export equal
transformers'; the first-step loss equals transformers' (1e-5 relative) on one process and at tp=2 x pp=2 with
sequence parallelism (slow)."""

import pytest
import transformers

from tests.hf_checks import (assert_generation_and_export_equal, first_step_loss_equals_transformers,
                             save_and_import)


def gemma4_together():
    return transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(
        vocab_size=251, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        num_kv_shared_layers=2, use_double_wide_mlp=True, max_position_embeddings=32, rms_norm_eps=1e-6,
        sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=251,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
        final_logit_softcapping=1.0, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1e6}}))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(transformers model, its directory, the imported megand checkpoint)."""
    return save_and_import(gemma4_together, tmp_path_factory.mktemp("gemma4_together"))


def test_generation_and_export_equal_transformers(imported, tmp_path, capsys):
    theirs, hf_dir, ckpt = imported
    config = assert_generation_and_export_equal(theirs, hf_dir, ckpt, str(tmp_path / "back"), capsys)
    for key in ("hidden_size_per_layer_input", "enable_moe_block", "num_kv_shared_layers", "attention_k_eq_v",
                "use_double_wide_mlp"):
        assert getattr(config, key) == getattr(theirs.config, key), key


def test_first_step_loss_equals_transformers(imported, tmp_path):
    theirs, _, ckpt = imported
    first_step_loss_equals_transformers("gemma4 together one", theirs, ckpt, 1, [], tmp_path)


@pytest.mark.slow
def test_first_step_loss_equals_transformers_at_tp2_pp2(imported, tmp_path):
    theirs, _, ckpt = imported
    # the sharing layers (4, 5) with their sources (2, 3) on the second stage
    first_step_loss_equals_transformers("gemma4 together tp2_pp2", theirs, ckpt, 4,
                                        ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
                                         "parallel.pipeline_layout=[2,4]"], tmp_path)
