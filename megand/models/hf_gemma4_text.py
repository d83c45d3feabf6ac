"""State-dict adapter: megand Gemma 4 models <-> ``transformers`` ``Gemma4ForCausalLM`` (Gemma 4's language
model, ``model_type`` gemma4_text).

Gemma 4 is Gemma 3 (sandwich norms, per-head q/k norms, GeGLU, embeddings scaled by sqrt(hidden), sliding and
full layers by ``layer_types`` with a RoPE each; see :mod:`megand.models.hf_gemma3_text`) with: plain RMSNorm
weights (``w``, not ``1 + w``), each value head normalised without a weight (``model.v_norm``), scores not
scaled at all (``scaling = 1``: the q/k norms set their size; megand's ``query_pre_attn_scalar=1``), the full
layers' ``proportional`` RoPE (``model.rope_scaling``), the logits soft-capped (``final_logit_softcapping``) and
a fixed ``layer_scalar`` per layer (a buffer in the files: imported only where it is 1, written as 1).

Per-layer input embeddings (``hidden_size_per_layer_input``: megand's ``model.per_layer_input_size``; see
:mod:`megand.core.transformer.per_layer_input`): the files pack every layer's table in one
``embed_tokens_per_layer [V, L·p]``, megand holds one per layer (with the layer, on its pipeline stage), joined
on export and cut on import. The MoE block (``enable_moe_block``: ``model.moe_beside_mlp``): routed GeGLU experts
beside the dense MLP, ``experts.gate_up_proj [E, 2f, h]`` (gate rows, then up rows) being megand's fused fc1.

Refused by name (megand cannot express them yet): key/value sharing across layers (``num_kv_shared_layers``), keys
equal to values (``attention_k_eq_v``), a head width or key/value heads of the full layers apart from the sliding
ones' (``per_layer_config``: ``global_head_dim``, ``num_global_key_value_heads``), bidirectional attention.
"""

from __future__ import annotations

import types

import torch

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
    # per-layer input embeddings and the MoE block (Gemma 4's own, in every layer)
    "per_layer_input_size": None, "per_layer_input_vocab_size": None, "moe_top_k": None, "moe_ffn_hidden_size": None,
    "num_experts": When("model.moe_beside_mlp=true (Gemma 4's MoE block)", lambda m: bool(m.get("moe_beside_mlp"))),
    "moe_beside_mlp": None}
# what megand cannot follow: the config.json key and the value that leaves it inert
INERT = {"num_kv_shared_layers": "key/value sharing across layers", "attention_k_eq_v": "keys equal to "
         "values", "use_bidirectional_attention": "bidirectional attention (megand's is causal)",
         "attention_bias": "attention biases"}


def hf_config(m: dict):
    from transformers import Gemma4TextConfig

    h, heads, groups, hd = dims(m)
    return Gemma4TextConfig(
        vocab_size=m["vocab_size"], hidden_size=h, intermediate_size=m["ffn_hidden_size"],
        num_hidden_layers=m["num_layers"], num_attention_heads=heads, num_key_value_heads=groups, head_dim=hd,
        global_head_dim=hd, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=m["seq_length"],
        initializer_range=m.get("init_std", 0.02), rms_norm_eps=norm_eps(m), rope_parameters=lg.rope_per_type(m),
        tie_word_embeddings=bool(m["tie_embeddings"]), attention_bias=False,
        attention_dropout=m.get("attention_dropout", 0.0), **lg.layer_types(m),
        final_logit_softcapping=m.get("final_logit_softcapping"), use_bidirectional_attention=None,
        num_kv_shared_layers=0, attention_k_eq_v=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        **ple_moe_hf(m))


def model_config(config) -> dict:
    """The megand ``model`` config of a ``Gemma4TextConfig``; ValueError naming what megand does not implement."""
    for key, what in INERT.items():
        if getattr(config, key, None):
            raise ValueError(f"{key}={getattr(config, key)}: megand has no {what}")
    if config.hidden_activation != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation={config.hidden_activation!r}: megand's GeGLU uses gelu_pytorch_tanh")
    # global_head_dim / num_global_key_value_heads land in per_layer_config (the config's own head_dim is then
    # ambiguous: read per layer)
    layers = [config.per_layer_config[i] for i in range(config.num_hidden_layers)]
    shapes = sorted({(layer.head_dim, layer.num_key_value_heads) for layer in layers})
    if len(shapes) > 1:
        raise ValueError(f"per_layer_config: the layers' (head_dim, num_key_value_heads) are {shapes}: megand's layers "
                         f"have one attention shape (global_head_dim, num_global_key_value_heads)")
    plain = types.SimpleNamespace(**{**config.to_dict(), "hidden_act": "silu", "rope_parameters": None,
                                     "use_sliding_window": False})
    cap = config.final_logit_softcapping
    return dict(llama_like_config(plain), **lg.rope(config), activation="geglu", qk_norm=True, v_norm=True,
                embedding_scale=True, norm_placement="sandwich", sliding_window=lg.windows(config),
                query_pre_attn_scalar=1, final_logit_softcapping=None if cap is None else float(cap),
                **ple_moe_model(config))


def constants(m: dict) -> dict[str, torch.Tensor]:
    """The tensors of the files that hold no megand weight: each layer's ``layer_scalar`` (1)."""
    return {f"model.layers.{i}.layer_scalar": torch.ones(1) for i in range(m["num_layers"])}


def rules(m: dict) -> list[Rule]:
    return gemma_rules(m) + ple_moe_rules(m)  # Gemma 3's names (the value norm has no weight), then Gemma 4's own


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
                                 "per_layer_config", "global_head_dim", "num_global_key_value_heads", *INERT,
                                 "hidden_size_per_layer_input", "vocab_size_per_layer_input", "enable_moe_block",
                                 "num_experts", "top_k_experts", "moe_intermediate_size"})
                | lg.READS,
                # inert without the features refused above: the wide MLP of the key/value-sharing layers; dropout is
                # a training choice
                ignores=frozenset({"attention_dropout", "use_double_wide_mlp"}),

                hf_config=hf_config, model_config=model_config, rules=rules, constants=constants)
