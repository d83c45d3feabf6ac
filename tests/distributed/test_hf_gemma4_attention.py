"""Gemma 4's attention shapes end to end: a tiny random Gemma 4 written by transformers' own ``save_pretrained``
whose full layers have a head width (32) and key/value heads (1) of their own, keys as values
(``attention_k_eq_v``) and the last two layers reading the keys and values of earlier ones
(``num_kv_shared_layers``, with their MLP twice as wide: ``use_double_wide_mlp``) is imported; greedy generation equals transformers' (the sharing layers read the
cache of the layer they share); a training run that names no model key has a first-step loss equal to
transformers' on the same batch (1e-5 relative) on one process and at tp=2 x pp=2 (the full layers' one
key/value head replicated over both tp ranks; the sharing layers with their sources on the last stage), cp=2
and under full recomputation; exported back, every weight equals the files transformers wrote."""

import pytest
import transformers

from tests.hf_checks import (assert_generation_and_export_equal, first_step_loss_equals_transformers,
                             save_and_import)

LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2


def gemma4(**changes):
    return transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**dict(
        vocab_size=251, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        num_kv_shared_layers=2, use_double_wide_mlp=True, max_position_embeddings=32, rms_norm_eps=1e-6, sliding_window=8,
        layer_types=LAYER_TYPES, hidden_size_per_layer_input=0, final_logit_softcapping=1.0,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1e6}}, **changes)))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(transformers model, its directory, the imported megand checkpoint)."""
    return save_and_import(gemma4, tmp_path_factory.mktemp("gemma4_attention"))


def test_generation_and_export_equal_transformers(imported, tmp_path, capsys):
    theirs, hf_dir, ckpt = imported
    config = assert_generation_and_export_equal(theirs, hf_dir, ckpt, str(tmp_path / "back"), capsys)
    mine, their = config.to_dict(), theirs.config.to_dict()
    for key in ("head_dim", "num_key_value_heads", "attention_k_eq_v", "num_kv_shared_layers", "use_double_wide_mlp",
                "layer_types"):
        assert mine[key] == their[key], key
    for i in range(6):
        mine, their = config.per_layer_config[i], theirs.config.per_layer_config[i]
        assert (mine.head_dim, mine.num_key_value_heads) == (their.head_dim, their.num_key_value_heads), i


# sources (layers 2 and 3) and their readers (4 and 5) on the second stage
LAYOUTS = {"one": (1, []),
           "tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
                           "parallel.pipeline_layout=[2,4]"]),
           "cp2": (2, ["parallel.cp=2"]),
           "tp2_recompute": (2, ["parallel.tp=2", "train.recompute=full", "optim.sharding=optim_grads_params"])}
DEFAULT = ["one"]
SLOW = [name for name in LAYOUTS if name not in DEFAULT]


@pytest.mark.parametrize("layout", DEFAULT)
def test_first_step_loss_equals_transformers(layout, imported, tmp_path):
    theirs, _, ckpt = imported
    nproc, overrides = LAYOUTS[layout]
    first_step_loss_equals_transformers(f"gemma4 attention {layout}", theirs, ckpt, nproc, overrides, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("layout", SLOW)
def test_first_step_loss_equals_transformers_matrix(layout, imported, tmp_path):
    theirs, _, ckpt = imported
    nproc, overrides = LAYOUTS[layout]
    first_step_loss_equals_transformers(f"gemma4 attention {layout}", theirs, ckpt, nproc, overrides, tmp_path)
