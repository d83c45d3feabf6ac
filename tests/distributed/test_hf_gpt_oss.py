"""GPT-OSS end to end: a tiny random ``GptOssForCausalLM`` written by transformers' own ``save_pretrained``
(attention sinks, biases on q/k/v/o, sliding-window and full layers alternating under a YaRN RoPE, every MLP a
MoE with a biased router and biased experts whose clamped SwiGLU clamps here: the limit is small) is imported;
greedy generation equals transformers'; a training run naming no model key has a first-step loss equal to
transformers' loss on the same batch (1e-5 relative) on one process, at ep=2 and (slow) at tp=2 x pp=2;
exported back, every tensor equals the files'; FLOPs equal ``FlopCounterMode`` on transformers' model."""

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from megand.models import flops, full
from megand.models.hf import build_hf_model
from megand.tools import convert_checkpoint
from tests.hf_checks import (assert_generation_and_export_equal, first_step_loss_equals_transformers,
                             save_and_import)

YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 8, "rope_theta": 150000.0}


def config(**changes):
    kw = dict(vocab_size=251, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
              max_position_embeddings=32, sliding_window=8, swiglu_limit=0.05, rope_parameters=YARN,
              rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return transformers.GptOssConfig(**dict(kw, **changes))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    def move_expert_biases(model):  # the experts' biases are 2-D
        for name, p in model.named_parameters():
            if p.dim() > 1 and name.endswith("_bias"):
                p.add_(torch.randn_like(p) * 0.5)

    return save_and_import(lambda: transformers.GptOssForCausalLM(config()), tmp_path_factory.mktemp("gpt_oss"),
                           scale=0.5, move=move_expert_biases)


def test_generation_and_export_equal_transformers(imported, tmp_path, capsys):
    theirs, hf_dir, ckpt = imported
    m = full.read_config(ckpt).model
    assert (m.attention_sinks, m.qkv_bias, m.attention_out_bias, m.moe_bias, m.swiglu_limit) == (True, True, True,
                                                                                                 True, 0.05)
    assert list(m.sliding_window) == [8, None, 8, None] and m.rope_scaling.rope_type == "yarn"
    back = assert_generation_and_export_equal(theirs, hf_dir, ckpt, str(tmp_path / "back"), capsys)
    assert type(back) is transformers.GptOssConfig  # the YaRN betas at their defaults are left out
    assert dict(back.rope_parameters, beta_fast=32.0, beta_slow=1.0) == theirs.config.rope_parameters
    assert (back.layer_types, back.swiglu_limit, back.swiglu_alpha) == (theirs.config.layer_types, 0.05, 1.702)


def test_flops_equal_flop_counter_on_transformers_model(imported):
    """Parameters and the model FLOPs of a training step equal transformers' own model's (eager attention and
    experts: every matmul visible to FlopCounterMode). Eager attention computes a sliding layer's whole s x s
    product, where megand counts the window's band (what a windowed kernel computes): the FLOPs are compared
    with every layer full."""
    _, _, ckpt = imported
    from omegaconf import OmegaConf

    m = OmegaConf.to_container(full.read_config(ckpt).model, resolve=True)
    model = build_hf_model(m, attn_implementation="eager", experts_implementation="eager")
    assert type(model).__name__ == "GptOssForCausalLM"
    assert flops.param_counts(m).total == sum(p.numel() for p in model.parameters())
    m = dict(m, sliding_window=None)
    model = build_hf_model(m, attn_implementation="eager", experts_implementation="eager")
    ids = torch.randint(0, m["vocab_size"], (2, m["seq_length"]), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    assert flops.flops_per_iteration(m, global_batch_size=2)["model_flops"] == counter.get_total_flops()


@pytest.mark.parametrize("changes, needle", [({"layer_types": ["chunked_attention"] + ["full_attention"] * 3},
                                              "layer_types holds 'chunked_attention'")])
def test_import_refuses_what_megand_cannot_express_in_one_line(changes, needle, tmp_path, capsys):
    transformers.GptOssForCausalLM(config(**changes)).save_pretrained(str(tmp_path / "hf"))
    capsys.readouterr()
    assert convert_checkpoint.main(["import", "--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and needle in err[0], err


def test_import_refuses_mxfp4_experts_in_one_line(imported, tmp_path, capsys):
    """The published files' MXFP4 experts (``quantization_config`` quant_method mxfp4) are refused by name."""
    import json
    import shutil

    _, hf_dir, _ = imported
    shutil.copytree(hf_dir, tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), quantization_config={"quant_method": "mxfp4"})))
    capsys.readouterr()
    assert convert_checkpoint.main(["import", "--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "quant_method='mxfp4'" in err[0], err


LAYOUTS = {"one": (1, []), "ep2": (2, ["parallel.ep=2"]),
           "tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2"])}


@pytest.mark.parametrize("layout", ["one", "ep2", pytest.param("tp2_pp2", marks=pytest.mark.slow)])
def test_first_step_loss_equals_transformers(layout, imported, tmp_path):
    theirs, _, ckpt = imported
    nproc, overrides = LAYOUTS[layout]
    first_step_loss_equals_transformers(f"gpt_oss {layout}", theirs, ckpt, nproc, overrides, tmp_path)
