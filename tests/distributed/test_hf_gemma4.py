"""Gemma 4 (its text model) end to end, one tiny random model per group of features, each written by
transformers' own ``save_pretrained`` and imported: greedy generation equals transformers'; a training run that
names no model key has a first-step loss equal to transformers' loss on the same batch (1e-5 relative) on one
process and at the layouts below; exported back, every weight (and each layer's ``layer_scalar``) equals the
files transformers wrote.

- ``plain``: what Gemma 4 holds beyond Gemma 3: plain (w) RMSNorm weights, the value heads normalised without a
  weight, unscaled scores, the full layers' proportional RoPE (a quarter of the frequencies turning), the logits
  soft-capped (a cap of 1 so that it bends these small logits), three sliding layers per full one, two
  key/value heads (at tp=2 x pp=2 one per rank).
- ``attention_shapes``: the full layers with a head width (32) and key/value heads (1) of their own, keys as
  values (``attention_k_eq_v``), the last two layers reading the keys and values of earlier ones
  (``num_kv_shared_layers``; generation reads the cache of the layer they share) with their MLP twice as wide
  (``use_double_wide_mlp``); at tp=2 x pp=2 the one key/value head replicated over both tp ranks, the sharing
  layers with their sources on the last stage.
- ``ple_moe``: per-layer input embeddings (each stage looks up its own layers' tables; the projected word
  embedding crosses the pipeline link; export joins the packed table from megand's per-layer ones) and the MoE
  block beside the MLP (at ep=2 two experts per rank).
- ``together``: every piece above in one model, as the small Gemma 4s combine them.
"""

import pytest
import transformers

from tests.hf_checks import (assert_generation_and_export_equal, first_step_loss_equals_transformers,
                             save_and_import)

BASE = dict(vocab_size=251, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, global_head_dim=16, max_position_embeddings=32, rms_norm_eps=1e-6,
            sliding_window=8, layer_types=["sliding_attention"] * 3 + ["full_attention"],
            hidden_size_per_layer_input=0, final_logit_softcapping=1.0, tie_word_embeddings=True,
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                             "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                "rope_theta": 1e6}})
ATTENTION_SHAPES = dict(num_hidden_layers=6, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                        num_kv_shared_layers=2, use_double_wide_mlp=True)
PLE_MOE = dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=251, enable_moe_block=True, num_experts=4,
               top_k_experts=2, moe_intermediate_size=32)
TP2_PP2 = ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]
SHARING_ON_ONE_STAGE = ["parallel.pipeline_layout=[2,4]"]  # sources (layers 2, 3) and readers (4, 5) together
TP2_RECOMPUTE = ["parallel.tp=2", "train.recompute=full", "optim.sharding=optim_grads_params"]

# name: (config changes, the config keys export must write back as transformers did, layouts, default layouts)
MODELS = {
    "plain": ({}, ("rope_parameters", "sliding_window", "layer_types", "final_logit_softcapping", "head_dim"),
              {"one": (1, []), "tp2_pp2": (4, TP2_PP2), "cp2": (2, ["parallel.cp=2"]), "tp2_recompute": (2, TP2_RECOMPUTE)},
              ["one"]),
    "attention_shapes": (ATTENTION_SHAPES, ("head_dim", "num_key_value_heads", "attention_k_eq_v",
                                            "num_kv_shared_layers", "use_double_wide_mlp", "layer_types"),
                         {"one": (1, []), "tp2_pp2": (4, TP2_PP2 + SHARING_ON_ONE_STAGE), "cp2": (2, ["parallel.cp=2"]),
                          "tp2_recompute": (2, TP2_RECOMPUTE)},
                         ["one"]),
    # its one-process model is the generation check's
    "ple_moe": (PLE_MOE, ("hidden_size_per_layer_input", "vocab_size_per_layer_input", "enable_moe_block",
                          "num_experts", "top_k_experts", "moe_intermediate_size"),
                {"one": (1, []), "tp2_pp2": (4, TP2_PP2), "ep2": (2, ["parallel.ep=2"]),
                 "tp2_recompute": (2, TP2_RECOMPUTE)},
                ["tp2_pp2"]),
    "together": ({**ATTENTION_SHAPES, **PLE_MOE}, ("hidden_size_per_layer_input", "enable_moe_block",
                                                   "num_kv_shared_layers", "attention_k_eq_v", "use_double_wide_mlp"),
                 {"one": (1, []), "tp2_pp2": (4, TP2_PP2 + SHARING_ON_ONE_STAGE)},
                 ["one"]),
}
CASES = [(model, layout) for model, (_, _, layouts, _) in MODELS.items() for layout in layouts]
DEFAULT = [case for case in CASES if case[1] in MODELS[case[0]][3]]
SLOW = [case for case in CASES if case not in DEFAULT]


@pytest.fixture(scope="module")
def imported(request, tmp_path_factory):
    """(transformers model, its directory, the imported megand checkpoint) of ``MODELS[request.param]``."""
    changes = MODELS[request.param][0]
    return save_and_import(lambda: transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**{**BASE, **changes})),
                           tmp_path_factory.mktemp(f"gemma4_{request.param}"))


@pytest.mark.parametrize("imported", list(MODELS), indirect=True)
def test_generation_and_export_equal_transformers(imported, request, tmp_path, capsys):
    theirs, hf_dir, ckpt = imported
    config = assert_generation_and_export_equal(theirs, hf_dir, ckpt, str(tmp_path / "back"), capsys)
    assert type(config) is type(theirs.config)
    mine, their = config.to_dict(), theirs.config.to_dict()  # per-layer keys are read whole from the dict
    for key in MODELS[request.node.callspec.params["imported"]][1]:
        assert mine[key] == their[key], key
    for i in range(theirs.config.num_hidden_layers):  # each layer's attention shape
        mine, their = config.per_layer_config[i], theirs.config.per_layer_config[i]
        assert (mine.head_dim, mine.num_key_value_heads) == (their.head_dim, their.num_key_value_heads), i


@pytest.mark.parametrize("imported, layout", DEFAULT, indirect=["imported"])
def test_first_step_loss_equals_transformers(imported, layout, request, tmp_path):
    _loss_equals(imported, request.node.callspec.params["imported"], layout, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("imported, layout", SLOW, indirect=["imported"])
def test_first_step_loss_equals_transformers_matrix(imported, layout, request, tmp_path):
    _loss_equals(imported, request.node.callspec.params["imported"], layout, tmp_path)


def _loss_equals(imported, model, layout, tmp_path):
    theirs, _, ckpt = imported
    nproc, overrides = MODELS[model][2][layout]
    first_step_loss_equals_transformers(f"gemma4 {model} {layout}", theirs, ckpt, nproc, overrides, tmp_path)
