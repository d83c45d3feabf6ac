"""One model schema: the run's ``model`` keys are core's TransformerConfig fields (Hydra's ``model`` group is
generated from it), the head width is derived once (in core) and every reader (layers, FLOPs, estimator,
checkpoint adapters) follows it; a key core does not declare is an error naming it."""

import ast
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ValidationError

from megand.core.transformer.config import MODEL_FIELDS, TransformerConfig
from megand.models import flops
from megand.models.full import param_metas, transformer_config
from megand.models.hf import dims
from megand.training.config import ConfigError, ModelConfig, compose, validate
from megand.training.config import transformer_config as run_transformer_config
from megand.training.model_schema import structured_schema

QWEN3_LIKE = dict(arch="llama", num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                  num_query_groups=2, head_dim=24, seq_length=32, vocab_size=256, norm="rmsnorm",
                  activation="swiglu", position_embedding="rope", tie_embeddings=False)


def test_the_model_group_is_generated_from_the_core_config():
    """Hydra's ``model`` schema is TransformerConfig's model fields, in its order, with its defaults; a field
    added to a core-style dataclass is a key of the schema generated from it, typed for OmegaConf."""
    core = [f for f in fields(TransformerConfig) if f.name in MODEL_FIELDS]
    assert [(f.name, f.default) for f in fields(ModelConfig)] == [(f.name, f.default) for f in core]
    assert ModelConfig.__wrapped__ is TransformerConfig

    @dataclass(frozen=True)
    class Toy:
        width: int = 8
        experts: int | None = None
        window: int | tuple | None = None
        runtime: str = "x"

    schema = OmegaConf.structured(structured_schema(Toy, "ToyModel", exclude={"runtime"}))
    assert OmegaConf.to_container(schema) == {"width": 8, "experts": None, "window": None}
    schema.experts, schema.window = 4, [2, None]
    with pytest.raises(ValidationError, match="could not be converted to Integer"):
        schema.width = "wide"
    with pytest.raises(ConfigAttributeError, match="Key 'runtime' not in 'ToyModel'"):
        schema.runtime = "y"


def test_no_dataclass_but_the_core_config_declares_the_model_keys():
    """One schema: no class of the package (a second structured config, a copy in a tool) annotates the
    model's keys but core's TransformerConfig."""
    root = Path(__file__).resolve().parents[2] / "megand"
    declaring = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = {s.target.id for s in node.body
                         if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
                if len(names & MODEL_FIELDS) > len(MODEL_FIELDS) // 2:
                    declaring.append(f"{path.relative_to(root.parent)}:{node.name}")
    assert declaring == ["megand/core/transformer/config.py:TransformerConfig"]


def test_head_dim_is_derived_when_null_and_widths_follow_it():
    derived = TransformerConfig(hidden_size=64, num_attention_heads=4, num_query_groups=2)
    assert (derived.head_dim, derived.query_width, derived.kv_width) == (16, 64, 32)
    apart = TransformerConfig(hidden_size=64, num_attention_heads=4, num_query_groups=2, head_dim=24)
    assert (apart.head_dim, apart.query_width, apart.kv_width) == (24, 96, 48)


def test_every_reader_agrees_with_the_core_config():
    cfg = transformer_config(QWEN3_LIKE)
    shape = flops.Shape.from_config(QWEN3_LIKE)
    assert (shape.head_dim, shape.q_dim, shape.kv_dim) == (cfg.head_dim, cfg.query_width, cfg.kv_width)
    assert dims(QWEN3_LIKE)[3] == cfg.head_dim
    shapes = {n: m.full_shape for n, m in param_metas(QWEN3_LIKE).items()}
    assert shapes["layers.0.attention.qkv.weight"] == (96 + 2 * 48, 64)
    assert shapes["layers.0.attention.proj.weight"] == (64, 96)
    counted = sum(torch.Size(s).numel() for s in shapes.values())
    assert flops.param_counts(QWEN3_LIKE).total == counted


def test_an_unknown_model_key_is_named_not_dropped():
    with pytest.raises(ValueError, match=r"unknown model key\(s\) model.kv_channels"):
        transformer_config({**QWEN3_LIKE, "kv_channels": 24})


def test_a_run_with_head_dim_apart_from_hidden_over_heads_validates():
    cfg = compose(["model=llama_tiny", "model.hidden_size=62", "model.head_dim=16"])
    validate(cfg, 1)
    assert run_transformer_config(cfg).query_width == 64
    with pytest.raises(ConfigError, match=r"model.hidden_size=62 is not divisible by model.num_attention_heads=4 "
                                          r"\(or set model.head_dim\)"):
        validate(compose(["model=llama_tiny", "model.hidden_size=62"]), 1)
    with pytest.raises(ConfigError, match="rope needs an even head dim, got 15"):
        validate(compose(["model=llama_tiny", "model.head_dim=15"]), 1)


def test_the_import_refusal_names_every_adapter():
    from types import SimpleNamespace

    from megand.models import hf_families

    with pytest.raises(ValueError) as e:
        hf_families.family_for_hf(SimpleNamespace(model_type="gemma3"))
    assert ", ".join(hf_families.FAMILIES) in str(e.value)


LATENT = dict(arch="llama", hidden_size=64, num_attention_heads=4, norm="rmsnorm", activation="swiglu",
              position_embedding="rope", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
              v_head_dim=10)


def test_latent_attention_widths_and_their_readers_agree():
    cfg = TransformerConfig(**LATENT)
    assert (cfg.multi_latent, cfg.head_dim, cfg.rope_dim, cfg.query_width, cfg.attention_output_width) == \
        (True, 20, 8, 80, 40)
    yarn = TransformerConfig(**LATENT, rope_scaling={"rope_type": "yarn", "factor": 40.0, "mscale_all_dim": 1.0,
                                                     "original_max_position_embeddings": 4096})
    assert yarn.softmax_scale == pytest.approx(20 ** -0.5 * (0.1 * torch.log(torch.tensor(40.0)).item() + 1) ** 2)
    model = {**LATENT, "num_layers": 2, "ffn_hidden_size": 96, "seq_length": 32, "vocab_size": 251,
             "tie_embeddings": False}
    counted = sum(torch.Size(m.full_shape).numel() for m in param_metas(model).values())
    assert flops.param_counts(model).total == counted


@pytest.mark.parametrize("changes, needle", [
    ({"qk_rope_head_dim": None}, "model.qk_rope_head_dim=None"),
    ({"qk_rope_head_dim": 7}, "(qk_rope_head_dim even)"),
    ({"num_query_groups": 2}, "model.num_query_groups=2 belong(s) to the standard attention"),
    ({"qk_norm": True}, "model.qk_norm=True belong(s)"),
    ({"position_embedding": "learned"}, "its decoupled head is rotary"),
    ({"num_experts": 8, "moe_router": "sigmoid", "moe_n_group": 3, "moe_topk_group": 1}, "divisible by n_group"),
    ({"num_experts": 8, "moe_router": "softmax", "moe_n_group": 4, "moe_topk_group": 2}, "moe_router=sigmoid (got softmax)"),
    ({"num_experts": 8, "moe_router": "sigmoid", "moe_n_group": 4}, "needs both"),
])
def test_latent_attention_and_grouped_routing_refuse_in_one_line(changes, needle):
    with pytest.raises(ValueError) as e:
        TransformerConfig(**{**LATENT, **changes})
    assert needle in str(e.value) and "\n" not in str(e.value)


PRESETS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "model").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_flops_shape_reads_every_preset_as_the_model_is_built(preset):
    """FLOPs, the estimator and the planner read a model through ``flops.Shape``: for every preset, and for
    the preset with every key the schema defaults left out, it says what core's config builds."""
    from omegaconf import OmegaConf

    model = OmegaConf.to_container(compose([f"model={preset}"]).model, resolve=True)
    defaults = {f.name: f.default for f in fields(TransformerConfig)}
    sparse = {k: v for k, v in model.items() if v != defaults.get(k)}  # only what the preset changes
    for mapping in (model, sparse):
        cfg, shape = TransformerConfig.from_model(mapping), flops.Shape.from_config(mapping)
        assert (shape.layers, shape.hidden, shape.ffn, shape.heads, shape.seq, shape.vocab) == (
            cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads, cfg.seq_length,
            cfg.vocab_size)
        assert (shape.head_dim, shape.q_dim, shape.kv_dim) == (cfg.head_dim, cfg.query_width, cfg.kv_width)
        assert shape.groups == (cfg.num_query_groups or cfg.num_attention_heads)
        assert (shape.swiglu, shape.layernorm, shape.learned_positions, shape.tied) == (
            cfg.activation in ("swiglu", "geglu"), cfg.norm == "layernorm", cfg.position_embedding == "learned",
            cfg.tie_embeddings)
        assert (shape.qkv_bias, shape.qk_norm, shape.experts, shape.mtp_layers) == (
            cfg.qkv_bias, cfg.qk_norm, cfg.num_experts or 0, cfg.mtp_layers)
