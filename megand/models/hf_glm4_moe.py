"""State-dict adapter: megand models <-> ``transformers`` ``Glm4MoeForCausalLM`` (GLM-4.5, GLM-4.5-Air, GLM-4.6).

Attention is LLaMA's with biases on q/k/v (``attention_bias``: megand's ``qkv_bias``; ``o_proj`` has none),
optional per-head q/k RMSNorms (``use_qk_norm``: ``qk_norm``), a head width of its own and partial rotary:
RoPE rotates the first ``partial_rotary_factor`` (0.5) of each head, by halves, as megand does. The MLPs are
DeepSeek-V3's: the first ``first_k_dense_replace`` layers dense, then MoE layers with the sigmoid router and its
``e_score_correction_bias`` (megand's ``expert_bias``), group-limited top-k, ``routed_scaling_factor`` and
``n_shared_experts`` ungated shared experts, in DeepSeek's file layout (:mod:`megand.models.hf_deepseek_v3`'s
rules, its multi-token prediction module ``model.layers.{num_hidden_layers + k}`` included: GLM-4.5 publishes one).
A model whose every layer is dense exports with ``first_k_dense_replace = num_hidden_layers``.
"""

from __future__ import annotations

import types

from megand.models.hf import Family, When, dims, equals, norm_eps
from megand.models.hf_deepseek_v3 import (DEEPSEEK_MOE, deepseek_moe_rules, mtp_marker, mtp_model_rules,
                                         sigmoid_moe_hf_keys, with_sigmoid_moe)
from megand.models.hf_llama import (ATTENTION, DROPOUT, LLAMA_LIKE_READS, LLAMA_MARKS, LLAMA_SHAPE, attention_rules,
                                    llama_like_config, mlp_rules, rope_parameters)

PARTIAL = When("model.partial_rotary_factor < 1 (GLM rotates part of each head)",
               lambda m: 0 < (m.get("partial_rotary_factor") or 1.0) < 1)
EXPRESSES = {**LLAMA_SHAPE, **ATTENTION, "qkv_bias": None, "qk_norm": None, "partial_rotary_factor": PARTIAL,
             "mtp_layers": None, "num_experts": DEEPSEEK_MOE, "moe_router": equals("moe_router", "sigmoid"),
             **dict.fromkeys(("moe_top_k", "moe_ffn_hidden_size", "moe_shared_experts", "moe_norm_topk_prob",
                              "moe_n_group", "moe_topk_group", "moe_routed_scaling_factor",
                              "moe_first_k_dense_replace"))}


def hf_config(m: dict):
    from transformers import Glm4MoeConfig

    h, heads, groups, hd = dims(m)
    routing = sigmoid_moe_hf_keys(m)
    rope = dict(rope_parameters(m), partial_rotary_factor=float(m["partial_rotary_factor"]))
    return Glm4MoeConfig(vocab_size=m["vocab_size"], hidden_size=h, intermediate_size=m["ffn_hidden_size"],
                         num_hidden_layers=m["num_layers"], num_attention_heads=heads, num_key_value_heads=groups,
                         head_dim=hd, hidden_act="silu", max_position_embeddings=m["seq_length"],
                         initializer_range=m.get("init_std", 0.02), rms_norm_eps=norm_eps(m), rope_parameters=rope,
                         tie_word_embeddings=bool(m["tie_embeddings"]), attention_bias=bool(m.get("qkv_bias")),
                         use_qk_norm=bool(m.get("qk_norm")), attention_dropout=m.get("attention_dropout", 0.0),
                         num_nextn_predict_layers=int(m.get("mtp_layers") or 0),
                         bos_token_id=None, eos_token_id=None, pad_token_id=None, **routing)


def model_config(config) -> dict:
    """The megand ``model`` config of a ``Glm4MoeConfig``; ValueError for what megand does not implement."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    partial = float(rope.pop("partial_rotary_factor", None) or getattr(config, "partial_rotary_factor", None) or 1.0)
    # the LLaMA-family keys, the partial rotary taken off (megand has it as its own key)
    plain = types.SimpleNamespace(**{**config.to_dict(), "rope_parameters": rope, "partial_rotary_factor": None,
                                     "use_sliding_window": False})
    m = dict(llama_like_config(plain), qkv_bias=bool(config.attention_bias), qk_norm=bool(config.use_qk_norm),
             partial_rotary_factor=partial, mtp_layers=int(getattr(config, "num_nextn_predict_layers", 0) or 0))
    return with_sigmoid_moe(m, config)


def rules(m: dict) -> list:
    def layer(p, q, moe):
        return attention_rules(m, p, q) + (deepseek_moe_rules(m, p, q) if moe else mlp_rules(p + "mlp.", q + "mlp."))

    return mtp_model_rules(m, layer)


FAMILY = Family("glm4_moe", "Glm4MoeForCausalLM", expresses=EXPRESSES, marks=LLAMA_MARKS | {"partial_rotary_factor"},
                reads=LLAMA_LIKE_READS | {"attention_bias", "use_qk_norm", "num_nextn_predict_layers",
                                          "first_k_dense_replace", "n_group", "topk_group", "n_routed_experts",
                                          "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                                          "routed_scaling_factor", "norm_topk_prob"},
                ignores=DROPOUT | {"output_router_logits"},  # a forward option (returns the router's logits)
                hf_config=hf_config, model_config=model_config, rules=rules, mtp_marker=mtp_marker)
