"""GLM-4.5 end to end: a tiny random ``Glm4MoeForCausalLM`` written by transformers' own ``save_pretrained``
(biases on q/k/v, per-head q/k norms, a head width of its own, RoPE on half of each head; a dense first layer,
then MoE layers with the sigmoid router, its correction bias, the routed scaling factor and a shared expert) is
imported; greedy generation equals transformers'; a training run naming no model key has a first-step loss
equal to transformers' loss on the same batch (1e-5 relative) on one process, at ep=2 and (slow) at tp=2 x pp=2;
exported back, every tensor equals the files'; FLOPs equal ``FlopCounterMode`` on transformers' model."""

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from megand.models import flops, full
from megand.models.hf import build_hf_model
from megand.tools import convert_checkpoint
from tests.hf_checks import (assert_generation_and_export_equal, first_step_loss_equals_transformers,
                             move_correction_biases, save_and_import)


def config(**changes):
    kw = dict(vocab_size=251, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=24, attention_bias=True, use_qk_norm=True,
              n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
              routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=32,
              rms_norm_eps=1e-5, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return transformers.Glm4MoeConfig(**dict(kw, **changes))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return save_and_import(lambda: transformers.Glm4MoeForCausalLM(config()), tmp_path_factory.mktemp("glm4_moe"),
                           move=move_correction_biases)


def test_generation_and_export_equal_transformers(imported, tmp_path, capsys):
    theirs, hf_dir, ckpt = imported
    m = full.read_config(ckpt).model
    assert (m.partial_rotary_factor, m.qkv_bias, m.qk_norm, m.moe_router, m.mtp_layers) == (0.5, True, True,
                                                                                            "sigmoid", 0)
    back = assert_generation_and_export_equal(theirs, hf_dir, ckpt, str(tmp_path / "back"), capsys)
    assert type(back) is transformers.Glm4MoeConfig and back.rope_parameters == theirs.config.rope_parameters
    assert (back.attention_bias, back.use_qk_norm, back.first_k_dense_replace) == (True, True, 1)


def test_flops_equal_flop_counter_on_transformers_model(imported):
    """Parameters and the model FLOPs of a training step equal transformers' own model's (eager attention and
    experts: every matmul visible to FlopCounterMode)."""
    _, _, ckpt = imported
    from omegaconf import OmegaConf

    m = OmegaConf.to_container(full.read_config(ckpt).model, resolve=True)
    model = build_hf_model(m, attn_implementation="eager", experts_implementation="eager")
    assert type(model).__name__ == "Glm4MoeForCausalLM"
    assert flops.param_counts(m).total == sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, m["vocab_size"], (2, m["seq_length"]), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    assert flops.flops_per_iteration(m, global_batch_size=2)["model_flops"] == counter.get_total_flops()


@pytest.mark.parametrize("changes, needle", [({"hidden_act": "gelu"}, "hidden_act='gelu'")])
def test_import_refuses_what_megand_cannot_express_in_one_line(changes, needle, tmp_path, capsys):
    transformers.Glm4MoeForCausalLM(config(**changes)).save_pretrained(str(tmp_path / "hf"))
    capsys.readouterr()
    assert convert_checkpoint.main(["import", "--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and needle in err[0], err


LAYOUTS = {"one": (1, []), "ep2": (2, ["parallel.ep=2"]),
           "tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.pipeline_layout=[2,1]"])}  # 3 layers


@pytest.mark.parametrize("layout", ["one", "ep2", pytest.param("tp2_pp2", marks=pytest.mark.slow)])
def test_first_step_loss_equals_transformers(layout, imported, tmp_path):
    theirs, _, ckpt = imported
    nproc, overrides = LAYOUTS[layout]
    first_step_loss_equals_transformers(f"glm4_moe {layout}", theirs, ckpt, nproc, overrides, tmp_path)
