"""DeepSeek-V3 end to end: a tiny random ``DeepseekV3ForCausalLM`` written by transformers' own
``save_pretrained`` (latent attention with a query latent, value heads narrower than query/key heads, yarn
RoPE with DeepSeek's attention temperature, interleaved RoPE rows; a dense first layer, then MoE layers with
the sigmoid router, its correction bias, group-limited top-k, the routed scaling factor and a shared expert)
is imported; its logits and greedy generation (through the latent KV cache) equal transformers'; a training
run that names no model key has a first-step loss equal to transformers' loss on the same batch (1e-5
relative) on one process, at tp=2 x pp=2 and at ep=2; exported back, every tensor equals the files'."""

import pytest
import torch
import transformers
from safetensors.torch import load_file

from megand.core.checkpointing import offline
from megand.models import full
from megand.tools import convert_checkpoint, generate
from tests.hf_checks import first_step_loss_equals_transformers

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def config(**changes):
    kw = dict(vocab_size=251, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
              n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1, max_position_embeddings=32,
              rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=YARN, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)
    return transformers.DeepseekV3Config(**dict(kw, **changes))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v3")
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config()).eval()
    with torch.no_grad():  # norm weights and the correction biases away from their init: a misplaced one shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.05)
    model.save_pretrained(str(root / "hf"))
    assert convert_checkpoint.main(["import", "--hf", str(root / "hf"), "--save", str(root / "ckpt")]) == 0
    return model, str(root / "hf"), str(root / "ckpt")


def test_logits_generation_and_export_equal_transformers(imported, tmp_path, capsys):
    theirs, hf_dir, ckpt = imported
    ids = torch.randint(0, 251, (2, 16), generator=torch.Generator().manual_seed(1))
    ours, _ = full.load_model(ckpt, offline.single_process_topology())
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids), theirs(ids).logits, rtol=1e-5, atol=1e-5)

    prompt = ids[0, :8].tolist()
    with torch.no_grad():
        expected = theirs.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                   pad_token_id=0)[0].tolist()
    capsys.readouterr()
    assert generate.main(["--load", ckpt, "--ids", *map(str, prompt), "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in expected]

    out = str(tmp_path / "back")
    assert convert_checkpoint.main(["export", "--load", ckpt, "--out", out, "--dtype", "fp32"]) == 0
    exported, original = load_file(f"{out}/model.safetensors"), load_file(f"{hf_dir}/model.safetensors")
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)
    assert transformers.AutoConfig.from_pretrained(out).rope_parameters == theirs.config.rope_parameters


@pytest.mark.parametrize("changes, needle", [({"attention_bias": True}, "attention_bias=true"),
                                             ({"rope_interleave": False}, "rope_interleave=false")])
def test_import_refuses_what_megand_cannot_express_in_one_line(changes, needle, tmp_path, capsys):
    transformers.DeepseekV3ForCausalLM(config(**changes)).save_pretrained(str(tmp_path / "hf"))
    capsys.readouterr()
    assert convert_checkpoint.main(["import", "--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and needle in err[0], err


LAYOUTS = {"one": (1, []), "tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2"]), "ep2": (2, ["parallel.ep=2"])}


@pytest.mark.parametrize("layout", ["one", "tp2_pp2"])
def test_first_step_loss_equals_transformers(layout, imported, tmp_path):
    _first_step_loss_equals_transformers(layout, imported, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2"])
def test_first_step_loss_equals_transformers_layouts(layout, imported, tmp_path):
    _first_step_loss_equals_transformers(layout, imported, tmp_path)


def _first_step_loss_equals_transformers(layout, imported, tmp_path):
    theirs, _, ckpt = imported
    nproc, overrides = LAYOUTS[layout]
    first_step_loss_equals_transformers(f"deepseek_v3 {layout}", theirs, ckpt, nproc, overrides, tmp_path)
