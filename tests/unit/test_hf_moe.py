"""Hugging Face conversion of Mixture-of-Experts models: MixtralForCausalLM, Qwen2MoeForCausalLM (gated
shared experts, q/k/v biases, dense layers between MoE layers) and Qwen3MoeForCausalLM (q/k norms, head_dim). Random megand checkpoints round-trip
through the published per-expert safetensors layout bit-identically, transformers computes the same logits
from the export, greedy decoding equals transformers' greedy generate, directories that transformers wrote
import, and what a family cannot express is refused up front in one line."""

import json

import pytest
import torch
import torch.distributed as dist
import transformers
from safetensors import safe_open

from megand.core.checkpointing import offline
from megand.models import full, hf, hf_families
from megand.tools import convert_checkpoint, generate

BASE = dict(arch="llama", num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
            seq_length=32, vocab_size=251, norm="rmsnorm", activation="swiglu", position_embedding="rope",
            rope_theta=10000.0, tie_embeddings=False, init_std=0.02, hidden_dropout=0.0, attention_dropout=0.0)
# every Mixtral layer is MoE: ffn_hidden_size (dense layers' width) is imported as the experts' width
MIXTRAL = dict(BASE, ffn_hidden_size=48, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=48)
# layers 0 and 2 MoE, layer 1 dense; 2 shared experts behind their gate; as Qwen publishes them: q/k/v biases,
# no top-k renormalisation, RMSNorm epsilon 1e-6
QWEN2_MOE = dict(BASE, num_layers=3, num_experts=8, moe_top_k=3, moe_ffn_hidden_size=32, moe_shared_experts=2,
                 moe_shared_expert_gate=True, moe_layer_freq=2, moe_norm_topk_prob=False, qkv_bias=True, norm_eps=1e-6)
# Qwen3-MoE: per-head q/k norms, a head width of its own, layers 0 and 2 MoE, no shared experts
QWEN3_MOE = dict(BASE, num_layers=3, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=32, moe_layer_freq=2,
                 moe_norm_topk_prob=True, qk_norm=True, head_dim=24, norm_eps=1e-6)
MODELS = {"mixtral": MIXTRAL, "qwen2_moe": QWEN2_MOE, "qwen3_moe": QWEN3_MOE}
CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


@pytest.fixture(scope="module")
def topo():
    yield offline.single_process_topology()
    dist.destroy_process_group()  # leave no process group to the next module


def run(capsys, *argv):
    """(exit code, stderr lines) of the converter."""
    capsys.readouterr()
    rc = convert_checkpoint.main(list(argv))
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def file_tensors(directory):
    """Name -> shape of every tensor in a directory's safetensors files."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    return out


@pytest.mark.parametrize("family", MODELS)
def test_rules_cover_the_model_and_the_files_transformers_writes(family, tmp_path):
    m = MODELS[family]
    adapter = hf_families.family_for_model(m)
    assert adapter.model_type == family
    rules = adapter.rules(m)
    assert sorted(r.megand for r in rules) == sorted(full.full_shapes(m))
    ours = {n: s for r in rules for n, s in r.hf_shapes(full.full_shapes(m)[r.megand]).items()}
    assert len(ours) == sum(len(r.hf) for r in rules)
    # the published layout: what save_pretrained writes for a model of the same config
    model = hf.build_hf_model(m)
    assert type(model).__name__ == CLASSES[family]
    model.save_pretrained(str(tmp_path))
    assert ours == file_tensors(tmp_path)
    # and back: the config transformers reads gives the same megand model
    back = adapter.model_config(transformers.AutoConfig.from_pretrained(str(tmp_path)))
    assert {k: back[k] for k in m} == m


@pytest.mark.parametrize("family", MODELS)
def test_round_trip_logits_and_greedy_generation(family, topo, tmp_path, capsys):
    m = dict(MODELS[family], init_std=0.3)  # peaked logits: no near-ties for greedy decoding to break differently
    ckpt, out, back = str(tmp_path / "ckpt"), str(tmp_path / "hf"), str(tmp_path / "back")
    full.save_random_model(ckpt, m, torch.float32, seed=5)
    assert run(capsys, "export", "--load", ckpt, "--out", out, "--dtype", "fp32", "--max-shard-size", "200KB")[0] == 0
    assert len(json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert run(capsys, "import", "--hf", out, "--save", back)[0] == 0
    before, after = offline.load_full_tensors(ckpt), offline.load_full_tensors(back)
    assert sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)

    ours, _ = full.load_model(ckpt, topo)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(theirs).__name__ == CLASSES[family]
    ids = torch.randint(0, m["vocab_size"], (2, m["seq_length"]), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(input_ids=ids) - theirs(input_ids=ids).logits).abs().max().item() <= 1e-4

    prompt = ids[0, :8].tolist()
    with torch.no_grad():
        expected = theirs.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                   pad_token_id=0)[0].tolist()
    assert len(set(expected[8:])) > 3  # the continuation is not one token repeated
    for kv_cache in (True, False):
        assert generate.generate(ours, prompt, 20, kv_cache=kv_cache) == expected


@pytest.mark.parametrize("family", MODELS)
def test_import_of_a_directory_written_by_transformers(family, topo, tmp_path, capsys):
    m = MODELS[family]
    torch.manual_seed(0)
    theirs = hf.build_hf_model(m).to(torch.bfloat16).eval()
    theirs.save_pretrained(str(tmp_path / "hf"), max_shard_size="100KB")
    assert run(capsys, "import", "--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt"))[0] == 0
    assert full.read_config(str(tmp_path / "ckpt")).model.num_experts == m["num_experts"]
    assert {t.dtype for t in offline.load_full_tensors(str(tmp_path / "ckpt")).values()} == {torch.bfloat16}
    ours, _ = full.load_model(str(tmp_path / "ckpt"), topo)
    # the reference reads the same files in fp32 (a bf16 model cast back with .float() keeps bf16-rounded
    # RoPE frequencies in some families' rotary buffers: Qwen3-MoE's)
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ids = torch.randint(0, m["vocab_size"], (2, m["seq_length"]), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(input_ids=ids) - reference(input_ids=ids).logits).abs().max().item() <= 1e-4


def write_config(tmp_path, family, **changes):
    """A transformers directory of ``family`` whose config.json has ``changes``."""
    m = MODELS[family]
    hf.build_hf_model(m).save_pretrained(str(tmp_path / "hf"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.update(changes)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    return str(tmp_path / "hf")


@pytest.mark.parametrize("family,changes,needle", [
    ("mixtral", {"sliding_window": 16}, "sliding_window=16"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    # sparse layers 1 and 3 of 4: Qwen's (i + 1) % 2 == 0 is not megand's i % freq == 0
    ("qwen2_moe", {"num_hidden_layers": 4, "layer_types": None, "mlp_only_layers": [],
                   "decoder_sparse_step": 2}, "sparse layers [1, 3]"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 40}, "shared_expert_intermediate_size=40"),
])
def test_import_refuses_what_megand_cannot_express_in_one_line(family, changes, needle, tmp_path, capsys):
    hf_dir = write_config(tmp_path, family, **changes)
    rc, err = run(capsys, "import", "--hf", hf_dir, "--save", str(tmp_path / "out"))
    assert rc == 2 and len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "out").exists()


def test_export_of_a_moe_model_no_family_expresses_is_one_line(tmp_path, capsys):
    # DeepSeek-V3-style: sigmoid router, ungated shared experts
    m = dict(BASE, num_experts=4, moe_top_k=2, moe_router="sigmoid", moe_shared_experts=1)
    full.save_random_model(str(tmp_path / "ckpt"), m)
    rc, err = run(capsys, "export", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"))
    # the nearest family is GLM-4.5's (a sigmoid router with ungated shared experts), which rotates part of each head
    assert rc == 2 and len(err) == 1 and "no Hugging Face family expresses" in err[0]
    assert "nearest: glm4_moe (needs model.partial_rotary_factor)" in err[0]
    assert not (tmp_path / "hf").exists()
