"""Gemma 4 (its text model) end to end: a tiny random model written by transformers' own ``save_pretrained`` is
imported; greedy generation equals transformers'; a training run that names no model key has a first-step loss
equal to transformers' loss on the same batch (1e-5 relative) on one process and at tp=2 x pp=2 (and cp=2);
exported back, every weight (and each layer's ``layer_scalar``) equals the files transformers wrote.

What it holds beyond Gemma 3: plain (w) RMSNorm weights, the value heads normalised without a weight, unscaled
scores, the full layers' proportional RoPE (a quarter of the frequencies turning), the logits soft-capped (a cap
of 1 so that it bends these small logits), three sliding layers per full one, two key/value heads (at tp=2 x
pp=2 one per rank)."""

import pytest
import transformers

from tests.hf_checks import (assert_generation_and_export_equal, first_step_loss_equals_transformers,
                             save_and_import)


def gemma4():
    return transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(
        vocab_size=251, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=16, max_position_embeddings=32, rms_norm_eps=1e-6,
        sliding_window=8, layer_types=["sliding_attention"] * 3 + ["full_attention"], hidden_size_per_layer_input=0,
        final_logit_softcapping=1.0, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1e6}}))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(transformers model, its directory, the imported megand checkpoint)."""
    return save_and_import(gemma4, tmp_path_factory.mktemp("gemma4"))


def test_generation_and_export_equal_transformers(imported, tmp_path, capsys):
    theirs, hf_dir, ckpt = imported
    config = assert_generation_and_export_equal(theirs, hf_dir, ckpt, str(tmp_path / "back"), capsys)
    assert type(config) is type(theirs.config)
    for key in ("rope_parameters", "sliding_window", "layer_types", "final_logit_softcapping", "head_dim"):
        assert getattr(config, key) == getattr(theirs.config, key), key


LAYOUTS = {"one": (1, []),
           "tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]),
           "cp2": (2, ["parallel.cp=2"]),
           "tp2_recompute": (2, ["parallel.tp=2", "train.recompute=full", "optim.sharding=optim_grads_params"])}
DEFAULT = ["one"]
SLOW = [name for name in LAYOUTS if name not in DEFAULT]


@pytest.mark.parametrize("layout", DEFAULT)
def test_first_step_loss_equals_transformers(layout, imported, tmp_path):
    theirs, _, ckpt = imported
    nproc, overrides = LAYOUTS[layout]
    first_step_loss_equals_transformers(f"gemma4 {layout}", theirs, ckpt, nproc, overrides, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("layout", SLOW)
def test_first_step_loss_equals_transformers_matrix(layout, imported, tmp_path):
    theirs, _, ckpt = imported
    nproc, overrides = LAYOUTS[layout]
    first_step_loss_equals_transformers(f"gemma4 {layout}", theirs, ckpt, nproc, overrides, tmp_path)
