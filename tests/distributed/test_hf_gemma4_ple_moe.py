"""Gemma 4's per-layer input embeddings (PLE) and MoE block end to end: a tiny random Gemma 4 text model with both on,
written by transformers' own ``save_pretrained``, is imported; greedy generation equals transformers'; a training
run that names no model key has a first-step loss equal to transformers' loss on the same batch (1e-5 relative) on
one process, at tp=2 x pp=2 (sequence parallel: each stage looks up its own layers' tables; the projected word
embedding crosses the pipeline link) and at ep=2 (two experts per rank); exported back, every weight equals the
files transformers wrote (the packed per-layer table joined from megand's per-layer ones)."""

import pytest
import transformers

from tests.hf_checks import (assert_generation_and_export_equal, first_step_loss_equals_transformers,
                             save_and_import)


def gemma4_ple_moe():
    return transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(
        vocab_size=251, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=16, max_position_embeddings=32, rms_norm_eps=1e-6,
        sliding_window=8, layer_types=["sliding_attention"] * 3 + ["full_attention"],
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=251,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
        final_logit_softcapping=1.0, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
        pad_token_id=None))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(transformers model, its directory, the imported megand checkpoint)."""
    return save_and_import(gemma4_ple_moe, tmp_path_factory.mktemp("gemma4_ple_moe"))


def test_generation_and_export_equal_transformers(imported, tmp_path, capsys):
    theirs, hf_dir, ckpt = imported
    config = assert_generation_and_export_equal(theirs, hf_dir, ckpt, str(tmp_path / "back"), capsys)
    for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input", "enable_moe_block", "num_experts",
                "top_k_experts", "moe_intermediate_size"):
        assert getattr(config, key) == getattr(theirs.config, key), key


LAYOUTS = {"one": (1, []),
           "tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]),
           "ep2": (2, ["parallel.ep=2"]),
           "tp2_recompute": (2, ["parallel.tp=2", "train.recompute=full", "optim.sharding=optim_grads_params"])}
DEFAULT = ["tp2_pp2"]  # the one-process model is the generation check's
SLOW = [name for name in LAYOUTS if name not in DEFAULT]


@pytest.mark.parametrize("layout", DEFAULT)
def test_first_step_loss_equals_transformers(layout, imported, tmp_path):
    theirs, _, ckpt = imported
    nproc, overrides = LAYOUTS[layout]
    first_step_loss_equals_transformers(f"gemma4 ple+moe {layout}", theirs, ckpt, nproc, overrides, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("layout", SLOW)
def test_first_step_loss_equals_transformers_matrix(layout, imported, tmp_path):
    theirs, _, ckpt = imported
    nproc, overrides = LAYOUTS[layout]
    first_step_loss_equals_transformers(f"gemma4 ple+moe {layout}", theirs, ckpt, nproc, overrides, tmp_path)
