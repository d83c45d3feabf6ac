"""State-dict adapter: megand Gemma 4 models <-> ``transformers`` ``Gemma4ForCausalLM`` (Gemma 4's language
model, ``model_type`` gemma4_text).

Gemma 4 is Gemma 3 (sandwich norms, per-head q/k norms, GeGLU, embeddings scaled by sqrt(hidden), sliding and
full layers by ``layer_types`` with a RoPE each; see :mod:`megand.models.hf_gemma3_text`) with: plain RMSNorm
weights (``w``, not ``1 + w``), each value head normalised without a weight (``model.v_norm``), scores not
scaled at all (``scaling = 1``: the q/k norms set their size; megand's ``query_pre_attn_scalar=1``), the full
layers' ``proportional`` RoPE (``model.rope_scaling``), the logits soft-capped (``final_logit_softcapping``) and
a fixed ``layer_scalar`` per layer (a buffer in the files: imported only where it is 1, written as 1).

The attention of the full layers may have a shape of its own (``per_layer_config``, which transformers fills
from ``global_head_dim`` and ``num_global_key_value_heads``: megand's ``model.global_head_dim`` and
``model.num_global_query_groups``) and values equal to its keys' projection (``attention_k_eq_v``:
``model.global_k_eq_v``, no ``v_proj``); the last ``num_kv_shared_layers`` layers read the keys and values of
the last earlier layer of their type (``model.num_kv_shared_layers``: no ``k_proj``, ``v_proj`` nor
``k_norm``), with an MLP twice as wide under ``use_double_wide_mlp`` (``model.double_wide_mlp``).

Refused by name (megand cannot express them yet): per-layer input embeddings (``hidden_size_per_layer_input``),
the MoE block (``enable_moe_block``), a ``per_layer_config`` that sets anything but a layer type's head width and key/value heads, bidirectional
attention.
"""

from __future__ import annotations

import types

import torch

from megand.core.transformer import TransformerConfig
from megand.core.transformer.attention import fuse_qkv, split_qkv
from megand.models import hf_local_global as lg
from megand.models.hf import SIZE, Family, Rule, When, dims, equals, norm_eps
from megand.models.hf_gemma3_text import rules as gemma_rules
from megand.models.hf_llama import ATTENTION, llama_like_config

MARKS = frozenset({"arch", "norm", "activation", "position_embedding", "norm_placement", "embedding_scale",
                   "qk_norm", "v_norm", "query_pre_attn_scalar"})
# transformers makes the last layer a full-attention one whatever layer_types says
LAST_FULL = When("a full-attention last layer", lambda m: lg.layer_types(m)["layer_types"][-1] == "full_attention")
EXPRESSES = {**SIZE, **ATTENTION, **{k: equals(k, v) for k, v in dict(
    arch="llama", norm="rmsnorm", activation="geglu", position_embedding="rope", norm_placement="sandwich",
    embedding_scale=True, qk_norm=True, v_norm=True, query_pre_attn_scalar=1).items()},
    "rope_theta": None, "rope_scaling": None, "sliding_window": When("one window size for the sliding layers and "
                                                                     "a full-attention last layer",
                                                                     lambda m: lg.ONE_WINDOW_SIZE.holds(m)
                                                                     and LAST_FULL.holds(m)),
    "rope_local_theta": lg.LOCAL_THETA, "final_logit_softcapping": None,
    # the full layers' own attention shape, their keys as values, the last layers reading earlier keys/values
    "global_head_dim": None, "num_global_query_groups": None, "global_k_eq_v": None, "num_kv_shared_layers": None,
    "double_wide_mlp": None}
# what megand cannot follow: the config.json key and the value that leaves it inert
INERT = {"hidden_size_per_layer_input": "per-layer input embeddings",
         "enable_moe_block": "the MoE block beside the MLP",
         "use_bidirectional_attention": "bidirectional attention (megand's is causal)",
         "attention_bias": "attention biases"}
# the attention shape a per_layer_config entry may set for a layer type
PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")


def hf_config(m: dict):
    from transformers import Gemma4TextConfig

    h, heads, groups, hd = dims(m)
    types = lg.layer_types(m)
    full = TransformerConfig.from_model(m).layer_config(types["layer_types"].index("full_attention"))
    # the full layers' shape, written per layer (transformers reads num_global_key_value_heads only with
    # attention_k_eq_v)
    per_layer = {i: dict(head_dim=full.head_dim, num_key_value_heads=full.query_groups)
                 for i, t in enumerate(types["layer_types"]) if t == "full_attention"}
    return Gemma4TextConfig(
        vocab_size=m["vocab_size"], hidden_size=h, intermediate_size=m["ffn_hidden_size"],
        num_hidden_layers=m["num_layers"], num_attention_heads=heads, num_key_value_heads=groups, head_dim=hd,
        global_head_dim=full.head_dim, per_layer_config=per_layer, hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=m["seq_length"],
        initializer_range=m.get("init_std", 0.02), rms_norm_eps=norm_eps(m), rope_parameters=lg.rope_per_type(m),
        tie_word_embeddings=bool(m["tie_embeddings"]), attention_bias=False,
        attention_dropout=m.get("attention_dropout", 0.0), **lg.layer_types(m),
        final_logit_softcapping=m.get("final_logit_softcapping"), use_bidirectional_attention=None,
        hidden_size_per_layer_input=0, num_kv_shared_layers=m.get("num_kv_shared_layers") or 0, enable_moe_block=False,
        attention_k_eq_v=bool(m.get("global_k_eq_v")), use_double_wide_mlp=bool(m.get("double_wide_mlp")),
        bos_token_id=None, eos_token_id=None, pad_token_id=None)


def model_config(config) -> dict:
    """The megand ``model`` config of a ``Gemma4TextConfig``; ValueError naming what megand does not implement."""
    for key, what in INERT.items():
        if getattr(config, key, None):
            raise ValueError(f"{key}={getattr(config, key)}: megand has no {what}")
    if config.hidden_activation != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation={config.hidden_activation!r}: megand's GeGLU uses gelu_pytorch_tanh")
    sliding, full = attention_shapes(config)
    plain = types.SimpleNamespace(**{**config.to_dict(), "hidden_act": "silu", "rope_parameters": None,
                                     "use_sliding_window": False, "head_dim": sliding[0],
                                     "num_key_value_heads": sliding[1]})
    cap = config.final_logit_softcapping
    return dict(llama_like_config(plain), **lg.rope(config), activation="geglu", qk_norm=True, v_norm=True,
                embedding_scale=True, norm_placement="sandwich", sliding_window=lg.windows(config),
                query_pre_attn_scalar=1, final_logit_softcapping=None if cap is None else float(cap),
                global_head_dim=full[0] if full[0] != sliding[0] else None,
                num_global_query_groups=full[1] if full[1] != sliding[1] else None,
                global_k_eq_v=bool(config.attention_k_eq_v), num_kv_shared_layers=int(config.num_kv_shared_layers),
                # inert without key/value-sharing layers
                double_wide_mlp=bool(config.use_double_wide_mlp and config.num_kv_shared_layers))


def attention_shapes(config) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (head_dim, num_key_value_heads) of the sliding layers (the full layers' without any) and of the full
    layers, from ``per_layer_config`` (where transformers writes global_head_dim / num_global_key_value_heads);
    ValueError naming it where it sets another key or where one layer type's layers differ."""
    overrides = config.to_dict().get("per_layer_config") or {}
    other = sorted({k for entry in overrides.values() for k in entry} - set(PER_LAYER_KEYS))
    if other:
        raise ValueError(f"per_layer_config sets {other}: megand's Gemma 4 layers differ only in "
                         f"{' and '.join(PER_LAYER_KEYS)} by layer type")
    shapes = {}
    for i, kind in enumerate(config.layer_types):
        layer = config.per_layer_config[i]
        shapes.setdefault(kind, set()).add((layer.head_dim, layer.num_key_value_heads))
    mixed = {k: sorted(v) for k, v in shapes.items() if len(v) > 1}
    if mixed:
        raise ValueError(f"per_layer_config: the layers of one type have several (head_dim, num_key_value_heads): "
                         f"{mixed}; megand's have one per type")
    full = shapes["full_attention"].pop()
    return (shapes["sliding_attention"].pop() if "sliding_attention" in shapes else full), full


def constants(m: dict) -> dict[str, torch.Tensor]:
    """The tensors of the files that hold no megand weight: each layer's ``layer_scalar`` (1)."""
    return {f"model.layers.{i}.layer_scalar": torch.ones(1) for i in range(m["num_layers"])}


def qkv_rule(cfg: TransformerConfig, i: int, p: str, q: str) -> Rule:
    """Layer ``i``'s fused QKV of its own shape <-> q_proj, and k_proj and v_proj where it has them (no v_proj:
    values equal to the keys; neither: keys and values of an earlier layer)."""
    shape, rows = cfg.layer_config(i), cfg.kv_rows(i)
    heads, groups, d = shape.num_attention_heads, shape.query_groups, shape.head_dim
    names = tuple(q + f"self_attn.{x}_proj.weight" for x in "qkv"[:1 + rows])
    return Rule(p + "attention.qkv.weight", names, lambda t: split_qkv(t, heads, groups, rows)[:1 + rows],
                lambda *w: fuse_qkv(*w, *(None,) * (2 - rows), groups, d))


def rules(m: dict) -> list[Rule]:
    """Gemma 3's names (the value norm has no weight), each layer's QKV of its own shape, no key norm in the
    layers that read earlier keys."""
    cfg = TransformerConfig.from_model(m)
    out = []
    for rule in gemma_rules(m):
        parts = rule.megand.split(".")
        i = int(parts[1]) if parts[0] == "layers" else None
        if rule.megand.endswith("attention.qkv.weight"):
            rule = qkv_rule(cfg, i, f"layers.{i}.", f"model.layers.{i}.")
        elif rule.megand.endswith("attention.k_norm.weight") and not cfg.kv_rows(i):
            continue
        out.append(rule)
    return out


FAMILY = Family("gemma4_text", "Gemma4ForCausalLM", expresses=EXPRESSES, marks=MARKS,
                reads=frozenset({"hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
                                 "head_dim", "hidden_activation", "intermediate_size", "vocab_size", "rms_norm_eps",
                                 "tie_word_embeddings", "initializer_range", "final_logit_softcapping",
                                 "per_layer_config", "global_head_dim", "num_global_key_value_heads",
                                 "attention_k_eq_v", "num_kv_shared_layers", "use_double_wide_mlp", *INERT})
                | lg.READS,
                # inert without the features refused above: the per-layer embeddings' vocabulary, the experts'
                # shape; dropout is a training choice
                ignores=frozenset({"attention_dropout", "vocab_size_per_layer_input",
                                   "num_experts", "top_k_experts", "moe_intermediate_size"}),
                hf_config=hf_config, model_config=model_config, rules=rules, constants=constants)
