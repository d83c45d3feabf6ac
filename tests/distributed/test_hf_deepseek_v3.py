"""DeepSeek-V3 end to end: a tiny random ``DeepseekV3ForCausalLM`` written by transformers' own
``save_pretrained`` (latent attention with a query latent, value heads narrower than query/key heads, yarn
RoPE with DeepSeek's attention temperature, interleaved RoPE rows; a dense first layer, then MoE layers with
the sigmoid router, its correction bias, group-limited top-k, the routed scaling factor and a shared expert)
is imported; its logits and greedy generation (through the latent KV cache) equal transformers'; a training
run that names no model key has a first-step loss equal to transformers' loss on the same batch (1e-5
relative) on one process, at tp=2 x pp=2 and at ep=2; exported back, every tensor equals the files'."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file

from megand.core.checkpointing import offline
from megand.models import full
from megand.tools import convert_checkpoint
from tests.hf_checks import (assert_generation_and_export_equal, first_step_loss_equals_transformers,
                             move_correction_biases, save_and_import)

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "mscale": 1.0, "mscale_all_dim": 1.0}


# a tiny DeepSeek-V3 (DeepSeek-V3.2's test adds its indexer)
SHAPE = dict(vocab_size=251, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
             num_attention_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
             n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1, max_position_embeddings=32,
             rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=YARN, bos_token_id=None,
             eos_token_id=None, pad_token_id=None)


def config(**changes):
    return transformers.DeepseekV3Config(**dict(SHAPE, **changes))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return save_and_import(lambda: transformers.DeepseekV3ForCausalLM(config()), tmp_path_factory.mktemp("deepseek_v3"),
                           move=move_correction_biases)


def test_logits_generation_and_export_equal_transformers(imported, tmp_path, capsys):
    theirs, hf_dir, ckpt = imported
    ids = torch.randint(0, 251, (2, 16), generator=torch.Generator().manual_seed(1))
    ours, _ = full.load_model(ckpt, offline.single_process_topology())
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids), theirs(ids).logits, rtol=1e-5, atol=1e-5)

    config = assert_generation_and_export_equal(theirs, hf_dir, ckpt, str(tmp_path / "back"), capsys,
                                                prompt=ids[0, :8].tolist())
    assert config.rope_parameters == theirs.config.rope_parameters


@pytest.mark.parametrize("changes, needle", [({"attention_bias": True}, "attention_bias=true"),
                                             ({"rope_interleave": False}, "rope_interleave=false")])
def test_import_refuses_what_megand_cannot_express_in_one_line(changes, needle, tmp_path, capsys):
    transformers.DeepseekV3ForCausalLM(config(**changes)).save_pretrained(str(tmp_path / "hf"))
    capsys.readouterr()
    assert convert_checkpoint.main(["import", "--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and needle in err[0], err


LAYOUTS = {"one": (1, []), "tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2"]), "ep2": (2, ["parallel.ep=2"])}


@pytest.mark.parametrize("layout", ["one", pytest.param("tp2_pp2", marks=pytest.mark.slow)])  # tp2 x pp2 import: qwen3's
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


# multi-token prediction: DeepSeek's MTP module stored after the main model's layers, as DeepSeek-V3 publishes it
L, H = 4, 64


@pytest.fixture(scope="module")
def imported_mtp(imported, tmp_path_factory):
    """The tiny model's files with one MTP module (random) added in DeepSeek's layout: ``model.layers.4.*``
    (enorm, hnorm, eh_proj, a MoE transformer layer, shared_head.norm) and copies of the word embedding and
    the output layer (embed_tokens, shared_head.head)."""
    from safetensors.torch import save_file

    theirs, hf_dir, _ = imported
    root = tmp_path_factory.mktemp("deepseek_v3_mtp")
    tensors = load_file(f"{hf_dir}/model.safetensors")
    g = torch.Generator().manual_seed(3)

    def rand_like(t, name):
        if t.dim() == 1:  # norms 1 + noise, the correction bias small noise: a misplaced one shows
            return (0.0 if "correction_bias" in name else 1.0) + 0.1 * torch.randn(t.shape, generator=g)
        return 0.05 * torch.randn(t.shape, generator=g)

    q = f"model.layers.{L}."
    mtp = {q + name[len("model.layers.3."):]: rand_like(t, name)
           for name, t in tensors.items() if name.startswith("model.layers.3.")}  # a MoE layer's tensors
    mtp.update({q + "enorm.weight": rand_like(torch.empty(H), ""), q + "hnorm.weight": rand_like(torch.empty(H), ""),
                q + "eh_proj.weight": rand_like(torch.empty(H, 2 * H), ""),
                q + "shared_head.norm.weight": rand_like(torch.empty(H), ""),
                q + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                q + "shared_head.head.weight": tensors["lm_head.weight"].clone()})
    (root / "hf").mkdir()
    save_file({**tensors, **mtp}, str(root / "hf" / "model.safetensors"), metadata={"format": "pt"})
    cfg = theirs.config.to_dict()
    cfg["num_nextn_predict_layers"] = 1
    transformers.DeepseekV3Config(**cfg).save_pretrained(str(root / "hf"))
    assert convert_checkpoint.main(["import", "--hf", str(root / "hf"), "--save", str(root / "ckpt")]) == 0
    return theirs, str(root / "hf"), str(root / "ckpt"), mtp


def deepseek_mtp_losses(theirs, mtp, tokens):
    """DeepSeek-V3's MTP loss per token ``[b, s - 1]`` of ``tokens [b, s + 1]`` (inputs ``tokens[:, :-1]``),
    written out from the files' tensors: the main model's output after its final norm and the embedding of the
    token one ahead, each RMS-normalised (hnorm, enorm), concatenated [embedding, hidden], projected (eh_proj),
    one transformer layer (transformers' own DeepSeek-V3 layer holding the module's weights), shared_head.norm
    and shared_head.head; the target is the token two ahead."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    q = f"model.layers.{L}."
    eps = theirs.config.rms_norm_eps

    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * mtp[q + name]

    block = DeepseekV3DecoderLayer(theirs.config, layer_idx=L).eval()  # a MoE layer (L >= first_k_dense_replace)
    block.load_state_dict({k[len(q):]: v for k, v in theirs_names(mtp, q).items()})
    ids = tokens[:, :-1]
    s = ids.shape[1]
    with torch.no_grad():
        hidden = theirs.model(input_ids=ids).last_hidden_state  # after the final norm
        embedded = theirs.model.embed_tokens(ids[:, 1:])  # the token one ahead of each position
        x = F.linear(torch.cat([rms(embedded, "enorm.weight"), rms(hidden[:, : s - 1], "hnorm.weight")], -1),
                     mtp[q + "eh_proj.weight"])
        positions = torch.arange(s - 1)[None]
        causal = torch.full((s - 1, s - 1), float("-inf")).triu(1)[None, None]
        x = block(x, attention_mask=causal, position_embeddings=theirs.model.rotary_emb(x, positions),
                  position_ids=positions)
        logits = F.linear(rms(x, "shared_head.norm.weight"), mtp[q + "shared_head.head.weight"])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 2:].flatten(), reduction="none").view(tokens.shape[0], s - 1)


def theirs_names(mtp, q):
    """The MTP module's transformer-layer tensors in the names of transformers' layer module (its routed experts
    fused per projection as the module holds them)."""
    layer = {k: v for k, v in mtp.items() if not k[len(q):].startswith(("enorm", "hnorm", "eh_proj", "shared_head",
                                                                         "embed_tokens"))}
    experts = sorted({int(k.split(".")[-3]) for k in layer if ".mlp.experts." in k})
    out = {k: v for k, v in layer.items() if ".mlp.experts." not in k}
    gate_up = [torch.cat([layer[f"{q}mlp.experts.{e}.gate_proj.weight"], layer[f"{q}mlp.experts.{e}.up_proj.weight"]])
               for e in experts]
    out[q + "mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    out[q + "mlp.experts.down_proj"] = torch.stack([layer[f"{q}mlp.experts.{e}.down_proj.weight"] for e in experts])
    return out


def test_mtp_module_imports_trains_with_deepseeks_formula_and_exports_back(imported_mtp, tmp_path):
    """The imported MTP depth's per-token loss equals DeepSeek's formula on the files' tensors; a run naming no
    model key (``checkpoint.load`` only) takes the depth from the checkpoint, its first-step loss equals
    transformers' and its logged mtp loss equals the formula's mean; export writes every file tensor back."""
    theirs, hf_dir, ckpt, mtp = imported_mtp
    ours, _ = full.load_model(ckpt, offline.single_process_topology())
    assert len(ours.mtp.depths) == 1
    tokens = torch.randint(0, 251, (2, 17), generator=torch.Generator().manual_seed(4))
    ours.train()
    with torch.no_grad():
        _, mtp_loss = ours(tokens[:, :-1], labels=tokens[:, 1:])
    torch.testing.assert_close(mtp_loss[0][:, 1:], deepseek_mtp_losses(theirs, mtp, tokens), rtol=1e-5, atol=1e-5)

    batch, record = first_step_loss_equals_transformers("deepseek_v3 mtp", theirs, ckpt, 1, [], tmp_path)
    expected = deepseek_mtp_losses(theirs, mtp, batch).mean().item()
    assert abs(record["mtp_loss"] - expected) <= 1e-5 * expected, (record["mtp_loss"], expected)

    out = str(tmp_path / "back")
    assert convert_checkpoint.main(["export", "--load", ckpt, "--out", out, "--dtype", "fp32"]) == 0
    exported, original = load_file(f"{out}/model.safetensors"), load_file(f"{hf_dir}/model.safetensors")
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)
    assert transformers.AutoConfig.from_pretrained(out).num_nextn_predict_layers == 1


def test_block_scaled_fp8_files_import_dequantized(imported, tmp_path):
    """DeepSeek-V3 publishes its weights in fp8 (e4m3) with a float32 ``weight_scale_inv`` per weight block
    (``quantization_config``: fp8, ``weight_block_size``): import dequantizes them (bf16, as DeepSeek's own
    conversion writes them) and reads the same weights as from the dequantized files."""
    from safetensors.torch import save_file

    theirs, hf_dir, _ = imported
    block = 16  # partial edge blocks too: e.g. kv_a_proj_with_mqa's 24 rows
    tensors, quantized, dequantized = load_file(f"{hf_dir}/model.safetensors"), {}, {}
    for name, t in tensors.items():
        if t.dim() != 2 or name.endswith(("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")):
            quantized[name] = dequantized[name] = t.to(torch.bfloat16)  # DeepSeek keeps these in bf16
            continue
        rows, cols = t.shape
        tiles = torch.nn.functional.pad(t, (0, -cols % block, 0, -rows % block)).unflatten(0, (-1, block)).unflatten(
            2, (-1, block))  # [R, block, C, block]
        scale = tiles.abs().amax(dim=(1, 3)) / 448.0
        q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).flatten(2).flatten(0, 1)[:rows, :cols]
        quantized[name], quantized[name + "_scale_inv"] = q.contiguous(), scale
        expanded = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
        dequantized[name] = (q.float() * expanded).to(torch.bfloat16)
    for directory, files, quant in (("fp8", quantized, {"quant_method": "fp8", "fmt": "e4m3",
                                                        "activation_scheme": "dynamic",
                                                        "weight_block_size": [block, block]}),
                                    ("bf16", {k: v.to(torch.bfloat16) for k, v in dequantized.items()}, None)):
        (tmp_path / directory).mkdir()
        save_file(files, str(tmp_path / directory / "model.safetensors"), metadata={"format": "pt"})
        cfg = theirs.config.to_dict()
        if quant:
            cfg["quantization_config"] = quant
        transformers.DeepseekV3Config(**cfg).save_pretrained(str(tmp_path / directory))
        assert convert_checkpoint.main(["import", "--hf", str(tmp_path / directory), "--save",
                                        str(tmp_path / f"ckpt_{directory}")]) == 0
    names = list(offline.tensor_shapes(str(tmp_path / "ckpt_bf16")))
    fp8, bf16 = (offline.load_tensors(str(tmp_path / f"ckpt_{d}"), names) for d in ("fp8", "bf16"))
    assert all(fp8[n].dtype == torch.bfloat16 and torch.equal(fp8[n], bf16[n]) for n in names)


@pytest.mark.slow
def test_mtp_module_first_step_at_tp2_pp2(imported_mtp, tmp_path):
    """The imported MTP depth at tp=2 x pp=2 (on the last stage, with its copy of the word embedding): the
    first-step loss equals transformers' and the mtp loss DeepSeek's formula."""
    theirs, _, ckpt, mtp = imported_mtp
    nproc, overrides = LAYOUTS["tp2_pp2"]
    batch, record = first_step_loss_equals_transformers("deepseek_v3 mtp tp2_pp2", theirs, ckpt, nproc, overrides,
                                                        tmp_path)
    expected = deepseek_mtp_losses(theirs, mtp, batch).mean().item()
    assert abs(record["mtp_loss"] - expected) <= 1e-5 * expected, (record["mtp_loss"], expected)
