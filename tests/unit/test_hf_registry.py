"""The registered Hugging Face families: no two express the same model (on a grid of the architecture-key
combinations the families express), each is chosen for its own model, and import reads or knowingly ignores
every key transformers writes into a family's config.json, refusing any other by name."""

import itertools
import json

import pytest
import transformers
from safetensors import safe_open

from megand.models import full, hf, hf_families
from megand.tools import convert_checkpoint

BASE = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, seq_length=32,
            vocab_size=251, tie_embeddings=False)
LLAMA = dict(BASE, arch="llama", norm="rmsnorm", activation="swiglu", position_embedding="rope", num_query_groups=2)
LATENT = dict(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10)
MOE = dict(num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32)
# Qwen3-Next's hybrid: a Gated DeltaNet layer, then gated attention; (1 + w) RMSNorms, partial rotary
NEXT = dict(layer_types=["linear_attention", "attention"], attention_output_gate=True, norm_unit_offset=True,
            partial_rotary_factor=0.25, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8)
GLM = dict(partial_rotary_factor=0.5)  # GLM-4.5: RoPE on half of each head
DSA = dict(dsa_index_topk=8, dsa_index_heads=2, dsa_index_head_dim=16)  # DeepSeek-V3.2's sparse attention
# Gemma 3 (sandwich and (1 + w) norms, GeGLU, scaled embeddings, a local RoPE base), OLMo 3 (norms on the branch
# outputs, q/k norms over the whole projections), SmolLM3 (a NoPE layer)
GEMMA3 = dict(activation="geglu", norm_placement="sandwich", norm_unit_offset=True, embedding_scale=True, qk_norm=True,
              sliding_window=[8, None], rope_local_theta=10000.0, rope_theta=1e6)
OLMO3 = dict(norm_placement="post", qk_norm=True, qk_norm_scope="projection", sliding_window=[8, None])
SMOLLM3 = dict(no_rope=[False, True])
# Gemma 4: Gemma 3's block with plain norms, value norms, unscaled scores, a proportional global RoPE, soft-capped logits
GEMMA4 = dict(GEMMA3, norm_unit_offset=False, v_norm=True, query_pre_attn_scalar=1, final_logit_softcapping=30.0,
              rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25})
# Gemma 4's per-layer input embeddings and its MoE block beside the MLP
GEMMA4_BLOCKS = dict(per_layer_input_size=8, moe_beside_mlp=True)
# GPT-OSS: attention sinks, biases on every attention projection, biased router and experts, clamped SwiGLU
GPT_OSS = dict(attention_sinks=True, qkv_bias=True, attention_out_bias=True, moe_bias=True, swiglu_limit=7.0)
# one model per family: what export must write as that family
FAMILY_MODELS = {
    "llama": LLAMA,
    "qwen2": dict(LLAMA, qkv_bias=True, sliding_window=[None, 8]),
    "qwen3": dict(LLAMA, qk_norm=True, head_dim=24),
    "mistral": dict(LLAMA, sliding_window=8, head_dim=24),
    "gpt2": dict(BASE, tie_embeddings=True),
    "mixtral": dict(LLAMA, **MOE),
    "qwen2_moe": dict(LLAMA, **MOE, moe_shared_experts=1, moe_shared_expert_gate=True, moe_layer_freq=2,
                      qkv_bias=True, moe_norm_topk_prob=False),
    "qwen3_moe": dict(LLAMA, **MOE, qk_norm=True, head_dim=24, moe_layer_freq=2),
    "deepseek_v3": dict(LLAMA, num_query_groups=None, **LATENT, **MOE, moe_router="sigmoid", moe_shared_experts=1,
                        moe_n_group=2, moe_topk_group=1, moe_first_k_dense_replace=1, mtp_layers=1),
    "qwen3_5_text": dict(LLAMA, **NEXT, qk_norm=True, head_dim=32),
    "qwen3_next": dict(LLAMA, **NEXT, qk_norm=True, head_dim=32, **MOE, moe_shared_experts=2, moe_shared_expert_gate=True),
    "glm4_moe": dict(LLAMA, **GLM, qkv_bias=True, qk_norm=True, head_dim=24, **MOE, moe_router="sigmoid",
                     moe_shared_experts=1, moe_first_k_dense_replace=1, moe_routed_scaling_factor=2.5),
    "gemma3_text": dict(LLAMA, **GEMMA3, head_dim=24, query_pre_attn_scalar=16),
    "olmo3": dict(LLAMA, **OLMO3),
    "smollm3": dict(LLAMA, **SMOLLM3),
    "gemma4_text": dict(LLAMA, **GEMMA4, head_dim=24, **GEMMA4_BLOCKS, **MOE),
    "gpt_oss": dict(LLAMA, **MOE, **GPT_OSS, sliding_window=[8, None]),
    "deepseek_v32": dict(LLAMA, num_query_groups=None, **LATENT, **MOE, moe_router="sigmoid", moe_shared_experts=1,
                         moe_first_k_dense_replace=1, **DSA),
}


def grid():
    """Every combination of the keys that tell the families apart (valid in the schema or not)."""
    moe = [{}] + [dict(MOE, moe_router=r, moe_shared_experts=s, moe_shared_expert_gate=g, moe_layer_freq=f,
                       moe_norm_topk_prob=n)
                  for r, s, g, f, n in itertools.product(("softmax", "sigmoid"), (0, 1), (False, True), (1, 2),
                                                         (True, False))]
    axes = [[BASE, LLAMA], [{}, {"num_query_groups": 4}, {"head_dim": 24}], [{}, {"qkv_bias": True}],
            [{}, {"qk_norm": True}], [{}, {"sliding_window": 8}, {"sliding_window": [None, 8]},
                                      {"sliding_window": [4, 8]}],
            moe, [{}, LATENT], [{}, NEXT, GLM]]
    # the local/global and NoPE families' keys over the attention axes, with and without MoE, latent attention
    # and linear attention (each MoE variant again would multiply the grid's size)
    local_global = axes[:5] + [[{}, MOE], [{}, LATENT], [{}, NEXT],
                               [GEMMA3, OLMO3, SMOLLM3, GEMMA4, dict(GEMMA4, **GEMMA4_BLOCKS), GPT_OSS]]
    # DeepSeek Sparse Attention over latent attention, with and without DeepSeek's MoE
    sparse = [axes[0], [{}, {"num_query_groups": None}], [{}, dict(MOE, moe_router="sigmoid", moe_shared_experts=1)],
              [LATENT], [DSA]]
    for parts in itertools.chain(itertools.product(*axes), itertools.product(*local_global), itertools.product(*sparse)):
        m = {}
        for part in parts:
            m.update(part)
        yield m


def test_no_two_families_express_the_same_model_and_each_is_on_the_grid():
    chosen = set()
    for m in grid():
        keys = hf_families.architecture(m)
        fits = [name for name, f in hf_families.FAMILIES.items() if not f.unexpressed(keys, m)]
        assert len(fits) <= 1, (fits, m)
        chosen.update(fits)
    assert chosen == set(hf_families.FAMILIES)


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_each_family_is_chosen_for_its_model(name):
    assert set(FAMILY_MODELS) == set(hf_families.FAMILIES)
    assert hf_families.family_for_model(FAMILY_MODELS[name]).model_type == name


def test_what_no_family_expresses_is_named(monkeypatch):
    with pytest.raises(ValueError, match=r"together; nearest: gpt2 \(no model.qk_norm=True\); families: llama, "):
        hf_families.family_for_model(dict(BASE, qk_norm=True))
    # a key of the schema that no registered family expresses (here: with GPT-2 the only family)
    monkeypatch.setattr(hf_families, "FAMILIES", {"gpt2": hf_families.FAMILIES["gpt2"]})
    with pytest.raises(ValueError, match=r"^no Hugging Face family expresses model.qk_norm=True \(families: gpt2\)$"):
        hf_families.family_for_model(dict(BASE, qk_norm=True))


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_rules_cover_the_model_and_write_the_files_transformers_writes(name, tmp_path):
    """Every tensor of the model has its rule, and the rules' Hugging Face names and shapes are those
    ``save_pretrained`` writes for the family's transformers model of the same config (DeepSeek's multi-token
    prediction module, which transformers' class drops, is tested in tests/distributed/test_hf_deepseek_v3.py)."""
    m = {k: v for k, v in FAMILY_MODELS[name].items() if k != "mtp_layers"}
    family = hf_families.family_for_model(m)
    shapes = full.checkpoint_shapes(m)
    rules = family.rules(m)
    assert sorted(r.megand for r in rules) == sorted(shapes)
    ours = {n: s for r in rules for n, s in r.hf_shapes(shapes[r.megand]).items()}
    # no two rules write one tensor, but the blocks of a packed one (each block once)
    packed = {}
    for r in rules:
        if r.block is not None:
            packed.setdefault(r.hf[0], []).append(r.block[1:])
    assert all(sorted(b) == [(i, len(b)) for i in range(len(b))] for b in packed.values())
    assert len(ours) == sum(len(r.hf) for r in rules if r.block is None) + len(packed)

    ours.update({n: tuple(t.shape) for n, t in (family.constants(m) if family.constants else {}).items()})
    model = hf.build_hf_model(m)
    assert type(model).__name__ == family.model_class
    model.save_pretrained(str(tmp_path))
    theirs = {}
    for path in sorted(tmp_path.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            theirs.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    assert ours == theirs


def write_config(tmp_path, name, **changes):
    """The config.json transformers writes for the family's model, with ``changes``; its directory."""
    family = hf_families.FAMILIES[name]
    family.hf_config(dict(FAMILY_MODELS[name])).save_pretrained(str(tmp_path))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), **changes)))
    return str(tmp_path)


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_import_reads_every_key_transformers_writes_and_refuses_another(name, tmp_path):
    family = hf_families.FAMILIES[name]
    assert not family.reads & family.ignores
    config, chosen = convert_checkpoint.read_hf_config(write_config(tmp_path / "ok", name))
    assert chosen is family
    back = family.model_config(config)
    assert hf_families.family_for_model(back) is family
    # every key transformers writes for the family's default config too
    transformers.AutoConfig.for_model(name).save_pretrained(str(tmp_path / "default"))
    default = json.loads((tmp_path / "default" / "config.json").read_text())
    assert hf_families.unread_keys(family, default, type(config).attribute_map) == []
    with pytest.raises(ValueError, match=f"config.json key\\(s\\) unknown_switch: the {name} adapter does not read"):
        convert_checkpoint.read_hf_config(write_config(tmp_path / "bad", name, unknown_switch=True))


def run(capsys, *argv):
    capsys.readouterr()
    rc = convert_checkpoint.main(list(argv))
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("name, changes, needle", [
    ("gpt2", {"scale_attn_weights": False}, "scale_attn_weights=false"),  # transformers leaves scores unscaled
    ("gpt2", {"add_cross_attention": True}, "add_cross_attention=true"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method='greedy'"),
    ("llama", {"use_sliding_window": True, "sliding_window": 8}, "sliding_window, use_sliding_window"),
])
def test_import_refuses_a_key_that_changes_the_model_in_one_line(name, changes, needle, tmp_path, capsys):
    hf_dir = write_config(tmp_path / "hf", name, **changes)
    rc, err = run(capsys, "import", "--hf", hf_dir, "--save", str(tmp_path / "out"))
    assert rc == 2 and len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "out").exists()


def test_deepseeks_published_keys_import():
    """DeepSeek-V3's published config.json carries keys of its own code (read, or knowingly ignored)."""
    family = hf_families.FAMILIES["deepseek_v3"]
    published = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1, "ep_size": 1,
                 "seq_aux": True, "aux_loss_alpha": 0.001, "auto_map": {}, "pretraining_tp": 1}
    assert hf_families.unread_keys(family, published) == []


def test_the_help_lists_the_registered_families(capsys):
    for argv in (["--help"], ["import", "--help"]):
        with pytest.raises(SystemExit):
            convert_checkpoint.main(argv)
        assert " ".join(capsys.readouterr().out.split()).count(hf_families.family_names()) == 1
