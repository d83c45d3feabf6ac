"""Kimi-K2 end to end: its files are DeepSeek-V3's architecture under ``model_type: kimi_k2`` (a config.json for
Moonshot's own code, which transformers does not have). A tiny random ``DeepseekV3ForCausalLM`` written by
transformers' own ``save_pretrained``, its config.json rewritten in Kimi-K2's published form (``kimi_k2``,
``auto_map``, the legacy ``rope_scaling`` yarn block, DeepSeek's own keys; Kimi's routing: one expert group, a
dense first layer, one shared expert, routed scaling 2.827), is imported as it is through the DeepSeek-V3
adapter; greedy generation equals transformers'; a training run naming no model key has a first-step loss
equal to transformers' (1e-5 relative) on one process (and at tp=2 x pp=2, ep=2: slow); export writes every
tensor back (as ``deepseek_v3``, which transformers loads)."""

import json

import pytest
import transformers

from megand.models import full
from megand.tools import convert_checkpoint
from tests.hf_checks import (assert_generation_and_export_equal, first_step_loss_equals_transformers,
                             move_correction_biases, save_and_import)

YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 1.0, "mscale_all_dim": 1.0,
        "beta_fast": 1.0, "beta_slow": 1.0}  # Kimi-K2's block (factor 32 from 4096 there)
SHAPE = dict(vocab_size=251, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
             routed_scaling_factor=2.827, first_k_dense_replace=1, max_position_embeddings=32, rms_norm_eps=1e-6,
             tie_word_embeddings=False, norm_topk_prob=True)
# what Kimi-K2's config.json holds beside the shape (Moonshot's code, DeepSeek's training keys)
PUBLISHED = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
             "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                          "AutoModel": "modeling_deepseek.DeepseekV3Model",
                          "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
             "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 163584,
             "eos_token_id": 163585, "ep_size": 1, "hidden_act": "silu", "initializer_range": 0.02,
             "moe_layer_freq": 1, "num_key_value_heads": 4, "num_nextn_predict_layers": 0, "pretraining_tp": 1,
             "rope_scaling": YARN, "rope_theta": 50000.0, "scoring_func": "sigmoid", "seq_aux": True,
             "topk_method": "noaux_tc", "torch_dtype": "float32", "transformers_version": "4.48.3", "use_cache": True}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    rope = {"rope_type": "yarn", "rope_theta": 50000.0, **{k: v for k, v in YARN.items() if k != "type"}}
    return save_and_import(
        lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **SHAPE, rope_parameters=rope, bos_token_id=None, eos_token_id=None, pad_token_id=None)),
        tmp_path_factory.mktemp("kimi_k2"), move=move_correction_biases,
        edit_files=lambda hf: (hf / "config.json").write_text(json.dumps({**SHAPE, **PUBLISHED}, indent=2)))


def test_imports_as_deepseek_v3_generates_and_exports_back(imported, tmp_path, capsys):
    theirs, hf_dir, ckpt = imported
    m = full.read_config(ckpt).model
    assert (m.kv_lora_rank, m.moe_n_group, m.moe_routed_scaling_factor, m.rope_scaling.rope_type) == (16, None, 2.827,
                                                                                                      "yarn")
    config = assert_generation_and_export_equal(theirs, hf_dir, ckpt, str(tmp_path / "back"), capsys)
    # export writes yarn's optional keys where they differ from their defaults (Kimi's beta_slow is yarn's 1)
    written = {k: v for k, v in theirs.config.rope_parameters.items() if (k, v) != ("beta_slow", 1.0)}
    assert config.model_type == "deepseek_v3" and config.rope_parameters == written


def test_import_refuses_an_unread_key_of_a_kimi_config(imported, tmp_path, capsys):
    _, hf_dir, _ = imported
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**SHAPE, **PUBLISHED, "unknown_switch": True}))
    capsys.readouterr()
    assert convert_checkpoint.main(["import", "--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "unknown_switch: the deepseek_v3 adapter does not read" in err[0], err


LAYOUTS = {"one": (1, []), "ep2": (2, ["parallel.ep=2"]),
           "tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.pipeline_layout=[2,1]"])}  # 3 layers


@pytest.mark.parametrize("layout", ["one", pytest.param("tp2_pp2", marks=pytest.mark.slow),
                                    pytest.param("ep2", marks=pytest.mark.slow)])
def test_first_step_loss_equals_transformers(layout, imported, tmp_path):
    theirs, _, ckpt = imported
    nproc, overrides = LAYOUTS[layout]
    first_step_loss_equals_transformers(f"kimi_k2 {layout}", theirs, ckpt, nproc, overrides, tmp_path)
