"""State-dict adapter: megand Gemma 3 models <-> ``transformers`` ``Gemma3ForCausalLM`` (Gemma 3's language
model, ``model_type`` gemma3_text).

Gemma 3 is the LLaMA layout with: sandwich norms (``input_layernorm`` and ``post_attention_layernorm`` around
attention, ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm`` around the MLP: megand's
``input_norm``, ``attention_output_norm``, ``post_attention_norm``, ``mlp_output_norm`` under
``model.norm_placement=sandwich``), every RMSNorm scaling by ``1 + w`` (``norm_unit_offset``), per-head q/k
norms, GeGLU (``gelu_pytorch_tanh`` gate), the word embeddings scaled by sqrt(hidden) (``embedding_scale``),
sliding-window (local) and full (global) layers by ``layer_types`` with a RoPE each (``rope_local_theta``), and
the scores scaled by ``query_pre_attn_scalar`` (megand's key when it is not the head width). Logit soft-capping
(Gemma 2's ``final_logit_softcapping`` / ``attn_logit_softcapping``; null in Gemma 3) and bidirectional attention
are refused by name.
"""

from __future__ import annotations

import types

from megand.models import hf_local_global as lg
from megand.models.hf import SIZE, Family, Rule, dims, equals, norm_eps
from megand.models.hf_llama import ATTENTION, attention_rules, embedding_rules, llama_like_config, mlp_rules

MARKS = frozenset({"arch", "norm", "activation", "position_embedding", "norm_placement", "norm_unit_offset",
                   "embedding_scale", "qk_norm"})
EXPRESSES = {**SIZE, **ATTENTION, **{k: equals(k, v) for k, v in dict(
    arch="llama", norm="rmsnorm", activation="geglu", position_embedding="rope", norm_placement="sandwich",
    norm_unit_offset=True, embedding_scale=True, qk_norm=True).items()},
    "rope_theta": None, "rope_scaling": None, "sliding_window": lg.ONE_WINDOW_SIZE, "rope_local_theta": lg.LOCAL_THETA,
    "query_pre_attn_scalar": None}


def hf_config(m: dict):
    from transformers import Gemma3TextConfig

    h, heads, groups, hd = dims(m)
    return Gemma3TextConfig(
        vocab_size=m["vocab_size"], hidden_size=h, intermediate_size=m["ffn_hidden_size"],
        num_hidden_layers=m["num_layers"], num_attention_heads=heads, num_key_value_heads=groups, head_dim=hd,
        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=m["seq_length"],
        initializer_range=m.get("init_std", 0.02), rms_norm_eps=norm_eps(m), rope_parameters=lg.rope_per_type(m),
        tie_word_embeddings=bool(m["tie_embeddings"]), attention_bias=False,
        attention_dropout=m.get("attention_dropout", 0.0),
        query_pre_attn_scalar=m.get("query_pre_attn_scalar") or hd, **lg.layer_types(m),
        final_logit_softcapping=None, attn_logit_softcapping=None, use_bidirectional_attention=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)


def model_config(config) -> dict:
    """The megand ``model`` config of a ``Gemma3TextConfig``; ValueError naming what megand does not implement."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(config, key, None) is not None:
            raise ValueError(f"{key}={getattr(config, key)}: megand has no logit soft-capping (Gemma 3's is null)")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=true: megand's attention is causal")
    if getattr(config, "attention_bias", False):
        raise ValueError("attention_bias=true: megand's Gemma attention has no biases")
    if config.hidden_activation != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation={config.hidden_activation!r}: megand's GeGLU uses gelu_pytorch_tanh")
    plain = types.SimpleNamespace(**{**config.to_dict(), "hidden_act": "silu", "rope_parameters": None,
                                     "use_sliding_window": False})
    out = dict(llama_like_config(plain), **lg.rope(config), activation="geglu", qk_norm=True, norm_unit_offset=True,
               embedding_scale=True, norm_placement="sandwich", sliding_window=lg.windows(config))
    head_dim = config.head_dim
    out["query_pre_attn_scalar"] = None if config.query_pre_attn_scalar == head_dim else int(config.query_pre_attn_scalar)
    return out


def rules(m: dict) -> list[Rule]:
    first, last = embedding_rules(m)
    out = first
    for i in range(m["num_layers"]):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        # Gemma's names: post_attention_layernorm is the attention's output norm, pre_feedforward_layernorm the
        # MLP's input norm (megand's post_attention_norm)
        out += [r for r in attention_rules(m, p, q) if not r.megand.endswith("post_attention_norm.weight")]
        out += [Rule(p + "attention_output_norm.weight", (q + "post_attention_layernorm.weight",)),
                Rule(p + "post_attention_norm.weight", (q + "pre_feedforward_layernorm.weight",)),
                Rule(p + "mlp_output_norm.weight", (q + "post_feedforward_layernorm.weight",))]
        out += mlp_rules(p + "mlp.", q + "mlp.")
    return out + last


FAMILY = Family("gemma3_text", "Gemma3ForCausalLM", expresses=EXPRESSES, marks=MARKS,
                reads=frozenset({"hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
                                 "head_dim", "hidden_activation", "intermediate_size", "vocab_size", "rms_norm_eps",
                                 "tie_word_embeddings", "initializer_range", "attention_bias", "query_pre_attn_scalar",
                                 "final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"})
                | lg.READS,
                # a training choice; the pattern's length once layer_types is written
                ignores=frozenset({"attention_dropout", "_sliding_window_pattern", "sliding_window_pattern"}),
                hf_config=hf_config, model_config=model_config, rules=rules)
