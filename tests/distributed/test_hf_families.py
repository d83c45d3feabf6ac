"""Today's open dense families end to end: a tiny random model written by transformers' own
``save_pretrained`` (Llama 3.1-style with llama3 RoPE scaling, Qwen2 with q/k/v biases, Qwen3 with q/k norms,
a head width apart from hidden/heads and yarn RoPE, Mistral with a sliding window shorter than the sequence
and NeMo-style without one, Qwen2 with its sliding window on the upper layers, Qwen3-MoE, Qwen3.5's language model
(dense) and Qwen3-Next (MoE): three Gated DeltaNet layers per gated full-attention layer) is imported; greedy generation equals transformers'; a training
run that names no model key (the model comes from the checkpoint) has a first-step loss equal to
transformers' loss on the same batch (1e-5 relative) on one process, at tp=2 x pp=2 and (MoE) at ep=2;
exported back, every weight equals the files transformers wrote."""

import pytest
import transformers

from tests.hf_checks import (assert_generation_and_export_equal, first_step_loss_equals_transformers,
                             imports_by_family)

COMMON = dict(vocab_size=251, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-6, tie_word_embeddings=False,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
QWEN3_NEXT = dict(COMMON, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=8, linear_conv_kernel_dim=4,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25})
FAMILIES = {
    "llama3_1": lambda: transformers.LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # Qwen2 with its sliding window on: layers from max_window_layers=2 on attend over their 8 latest keys
    "qwen2_swa": lambda: transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8,
                                                  max_window_layers=2,
                                                  rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
    # Mistral NeMo-style: a head width of its own, no sliding window
    "mistral": lambda: transformers.MistralConfig(**COMMON, head_dim=24, sliding_window=None,
                                                  rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # Mistral 7B v0.1-style: every layer attends over its 8 latest keys (of 32 positions)
    "mistral_swa": lambda: transformers.MistralConfig(**COMMON, sliding_window=8,
                                                      rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=24,
                                              rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                               "original_max_position_embeddings": 8}),
    # Qwen3-MoE: q/k norms, a head width of its own, every layer MoE (softmax top-2 of 4, renormalised)
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, head_dim=24, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=48, norm_topk_prob=True,
                                                     rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # Qwen3.5 (its language model) and Qwen3-Next: Gated DeltaNet layers 0-2, gated full attention (partial
    # rotary, q/k norms) on layer 3, (1 + w) RMSNorms; Qwen3.5 dense, Qwen3-Next every layer MoE with its gated
    # shared expert
    "qwen3_5": lambda: transformers.Qwen3_5TextConfig(**QWEN3_NEXT),
    "qwen3_next_moe": lambda: transformers.Qwen3NextConfig(**QWEN3_NEXT, num_experts=4, num_experts_per_tok=2,
                                                           moe_intermediate_size=48,
                                                           shared_expert_intermediate_size=96),
}
CLASSES = {"llama3_1": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen2_swa": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "mistral": "MistralForCausalLM", "mistral_swa": "MistralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
           "qwen3_5": "Qwen3_5ForCausalLM", "qwen3_next_moe": "Qwen3NextForCausalLM"}
EXPORTED_AS = {"mistral": transformers.LlamaConfig}  # no megand key marks the family: the same maths as Llama


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """``imported(family)`` -> (transformers model, its directory, the imported megand checkpoint)."""
    return imports_by_family(tmp_path_factory,
                             lambda family: lambda: getattr(transformers, CLASSES[family])(FAMILIES[family]()))


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_and_export_equal_transformers(family, imported, tmp_path, capsys):
    theirs, hf_dir, ckpt = imported(family)
    config = assert_generation_and_export_equal(theirs, hf_dir, ckpt, str(tmp_path / "back"), capsys)
    assert type(config) is EXPORTED_AS.get(family, type(theirs.config))
    assert config.rope_parameters == theirs.config.rope_parameters
    for key in ("sliding_window", "layer_types", "use_sliding_window"):  # the windowed layers, where a family has them
        if hasattr(theirs.config, key) and type(config) is type(theirs.config):
            assert getattr(config, key) == getattr(theirs.config, key), key


def test_qwen_windows_map_to_per_layer_windows(imported):
    """transformers' rule: with use_sliding_window, layer i has the window when i >= max_window_layers."""
    from megand.models import full

    _, _, ckpt = imported("qwen2_swa")
    assert full.read_config(ckpt).model.sliding_window == [None, None, 8, 8]


LAYOUTS = {"one": (1, []), "tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2"]), "ep2": (2, ["parallel.ep=2"])}
CASES = [(f, l) for f in FAMILIES for l in LAYOUTS if l != "ep2" or f in ("qwen3_moe", "qwen3_next_moe")]  # ep: MoE
# the default suite: every family on one process, the one with the most features at tp=2 x pp=2 as well (and
# the hybrid linear-attention one), and the MoE family at ep=2
DEFAULT = [c for c in CASES if c[1] == "one" or c[0] == "qwen3" or c in (("qwen3_moe", "ep2"),
                                                                           ("qwen3_5", "tp2_pp2"))]
SLOW = [c for c in CASES if c not in DEFAULT]


@pytest.mark.parametrize("family, layout", DEFAULT, ids=[f"{f}-{l}" for f, l in DEFAULT])
def test_first_step_loss_equals_transformers(family, layout, imported, tmp_path):
    _first_step_loss_equals_transformers(family, layout, imported, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", SLOW, ids=[f"{f}-{l}" for f, l in SLOW])
def test_first_step_loss_equals_transformers_matrix(family, layout, imported, tmp_path):
    _first_step_loss_equals_transformers(family, layout, imported, tmp_path)


def _first_step_loss_equals_transformers(family, layout, imported, tmp_path):
    theirs, _, ckpt = imported(family)
    nproc, overrides = LAYOUTS[layout]
    first_step_loss_equals_transformers(f"{family} {layout}", theirs, ckpt, nproc, overrides, tmp_path)
