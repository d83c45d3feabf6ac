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

Per-layer input embeddings (``hidden_size_per_layer_input``: megand's ``model.per_layer_input_size``; see
:mod:`megand.core.transformer.per_layer_input`): the files pack every layer's table in one
``embed_tokens_per_layer [V, L·p]``, megand holds one per layer (with the layer, on its pipeline stage), joined
on export and cut on import. The MoE block (``enable_moe_block``: ``model.moe_beside_mlp``): routed GeGLU experts
beside the dense MLP, ``experts.gate_up_proj [E, 2f, h]`` (gate rows, then up rows) being megand's fused fc1.

Refused by name (megand cannot express them yet): a ``per_layer_config`` that sets anything but a layer type's
head width and key/value heads, bidirectional attention.
"""

from __future__ import annotations

import types

import torch

from megand.core.transformer import TransformerConfig
from megand.core.transformer.attention import fuse_qkv, split_qkv
from megand.core.transformer.mlp import fuse_swiglu, split_swiglu
from megand.models import hf_local_global as lg
from megand.models.hf import SIZE, Family, Rule, When, dims, equals, is_moe_layer, norm_eps
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
    "double_wide_mlp": None,
    # per-layer input embeddings and the MoE block (Gemma 4's own, in every layer)
    "per_layer_input_size": None, "per_layer_input_vocab_size": None, "moe_top_k": None, "moe_ffn_hidden_size": None,
    "num_experts": When("model.moe_beside_mlp=true (Gemma 4's MoE block)", lambda m: bool(m.get("moe_beside_mlp"))),
    "moe_beside_mlp": None}
# what megand cannot follow: the config.json key and the value that leaves it inert
INERT = {"use_bidirectional_attention": "bidirectional attention (megand's is causal)",
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
        num_kv_shared_layers=m.get("num_kv_shared_layers") or 0, attention_k_eq_v=bool(m.get("global_k_eq_v")),
        use_double_wide_mlp=bool(m.get("double_wide_mlp")), bos_token_id=None, eos_token_id=None, pad_token_id=None,
        **ple_moe_hf(m))


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
                double_wide_mlp=bool(config.use_double_wide_mlp and config.num_kv_shared_layers),
                **ple_moe_model(config))


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
    return out + ple_moe_rules(m)  # Gemma 3's names and Gemma 4's attention shapes, then its own blocks


# ---------------------------------------------------------------- per-layer input embeddings and the MoE block
def ple_moe_hf(m: dict) -> dict:
    """The ``Gemma4TextConfig`` keys of megand's per-layer input embeddings and MoE block."""
    experts = m.get("num_experts")
    return dict(hidden_size_per_layer_input=m.get("per_layer_input_size") or 0,
                vocab_size_per_layer_input=m.get("per_layer_input_vocab_size") or m["vocab_size"],
                enable_moe_block=bool(experts), num_experts=experts,
                top_k_experts=m.get("moe_top_k", 2) if experts else None,
                moe_intermediate_size=(m.get("moe_ffn_hidden_size") or m["ffn_hidden_size"]) if experts else None)


def ple_moe_model(config) -> dict:
    """The megand ``model`` keys of a ``Gemma4TextConfig``'s per-layer input embeddings and MoE block."""
    out = {}
    if config.hidden_size_per_layer_input:
        rows = config.vocab_size_per_layer_input
        if rows < config.vocab_size:  # transformers' lookup fails on the ids beyond it
            raise ValueError(f"vocab_size_per_layer_input={rows} is below vocab_size={config.vocab_size}: megand's "
                             f"per-layer tables hold a row for every id")

        out.update(per_layer_input_size=config.hidden_size_per_layer_input,
                   per_layer_input_vocab_size=None if rows == config.vocab_size else rows)
    if config.enable_moe_block:
        out.update(num_experts=config.num_experts, moe_top_k=config.top_k_experts,
                   moe_ffn_hidden_size=config.moe_intermediate_size, moe_beside_mlp=True, moe_router="softmax",
                   moe_norm_topk_prob=True)
    return out


def _gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor]:
    """megand's fused experts' fc1 ``[E, 2f, h]`` (rows: gate, up, gate, ...) -> Gemma 4's ``gate_up_proj`` (each
    expert's gate rows, then its up rows)."""
    return (torch.stack([torch.cat(split_swiglu(expert)) for expert in fc1]),)


def _fused(gate_up: torch.Tensor) -> torch.Tensor:
    return torch.stack([fuse_swiglu(*expert.chunk(2)) for expert in gate_up])


def ple_moe_rules(m: dict) -> list[Rule]:
    """The rules of the per-layer input embeddings (every layer's table a block of the one packed table, their
    rules together so that export joins them at once) and of each layer's MoE block."""
    out, layers = [], m["num_layers"]
    if m.get("per_layer_input_size"):
        out += [Rule("per_layer_inputs.weight", ("model.per_layer_model_projection.weight",)),
                Rule("per_layer_inputs.norm.weight", ("model.per_layer_projection_norm.weight",))]
        out += [Rule(f"layers.{i}.per_layer_input.embedding.weight", ("model.embed_tokens_per_layer.weight",),
                     block=(1, i, layers)) for i in range(layers)]
        for i in range(layers):
            p, q = f"layers.{i}.per_layer_input.", f"model.layers.{i}."
            out += [Rule(p + "gate", (q + "per_layer_input_gate.weight",)),
                    Rule(p + "up", (q + "per_layer_projection.weight",)),
                    Rule(p + "norm.weight", (q + "post_per_layer_input_norm.weight",))]
    for i in (i for i in range(layers) if is_moe_layer(m, i)):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        out += [Rule(p + "moe_input_norm.weight", (q + "pre_feedforward_layernorm_2.weight",)),
                Rule(p + "mlp_branch_norm.weight", (q + "post_feedforward_layernorm_1.weight",)),
                Rule(p + "moe_output_norm.weight", (q + "post_feedforward_layernorm_2.weight",)),
                Rule(p + "moe.router.weight", (q + "router.proj.weight",)),
                Rule(p + "moe.router.norm.weight", (q + "router.scale",)),
                Rule(p + "moe.router.expert_scale", (q + "router.per_expert_scale",)),
                Rule(p + "moe.experts.fc1.weight", (q + "experts.gate_up_proj",), _gate_up, _fused),
                Rule(p + "moe.experts.fc2.weight", (q + "experts.down_proj",))]
    return out


FAMILY = Family("gemma4_text", "Gemma4ForCausalLM", expresses=EXPRESSES, marks=MARKS,
                reads=frozenset({"hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
                                 "head_dim", "hidden_activation", "intermediate_size", "vocab_size", "rms_norm_eps",
                                 "tie_word_embeddings", "initializer_range", "final_logit_softcapping",
                                 "per_layer_config", "global_head_dim", "num_global_key_value_heads",
                                 "attention_k_eq_v", "num_kv_shared_layers", "use_double_wide_mlp", *INERT,
                                 "hidden_size_per_layer_input", "vocab_size_per_layer_input", "enable_moe_block",
                                 "num_experts", "top_k_experts", "moe_intermediate_size"})
                | lg.READS,
                ignores=frozenset({"attention_dropout"}),  # dropout is a training choice
                hf_config=hf_config, model_config=model_config, rules=rules, constants=constants)
