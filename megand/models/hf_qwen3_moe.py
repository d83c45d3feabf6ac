"""State-dict adapter: megand Qwen3-MoE-style models <-> ``transformers`` ``Qwen3MoeForCausalLM``.

Qwen3's attention (per-head q/k RMSNorm, ``model.qk_norm``; a head width of its own, ``model.head_dim``) with
MoE layers of routed SwiGLU experts behind a softmax top-k router (``moe_norm_topk_prob`` is Qwen's
``norm_topk_prob``) and no shared experts; the dense layers between them (``mlp_only_layers`` /
``decoder_sparse_step``) are megand's ``moe_layer_freq``. Per layer the files hold ``mlp.gate`` (megand's
``mlp.router``) and per expert ``gate_proj``, ``up_proj`` and ``down_proj``.
"""

from __future__ import annotations

from megand.models.hf import Family, Rule, When, dims, moe_layer_ids, norm_eps
from megand.models.hf_llama import (ATTENTION, DROPOUT, LLAMA_LIKE_READS, LLAMA_MARKS, LLAMA_SHAPE, QWEN_WINDOW_READS,
                                    llama_like_config, rope_parameters)
from megand.models.hf_qwen2_moe import QWEN_MOE, QWEN_MOE_READS, _layer_freq, expert_width, moe_model_rules

EVERY_LAYER = When("one window for every layer (an int)",
                   lambda m: not isinstance(m.get("sliding_window"), (list, tuple)))


def hf_config(m: dict):
    from transformers import Qwen3MoeConfig

    h, heads, groups, hd = dims(m)
    moe = set(moe_layer_ids(m))
    return Qwen3MoeConfig(vocab_size=m["vocab_size"], hidden_size=h, intermediate_size=m["ffn_hidden_size"],
                          num_hidden_layers=m["num_layers"], num_attention_heads=heads, num_key_value_heads=groups,
                          head_dim=hd, hidden_act="silu", max_position_embeddings=m["seq_length"],
                          initializer_range=m.get("init_std", 0.02), rms_norm_eps=norm_eps(m),
                          rope_parameters=rope_parameters(m), tie_word_embeddings=bool(m["tie_embeddings"]),
                          attention_bias=False, use_sliding_window=m.get("sliding_window") is not None,
                          sliding_window=m.get("sliding_window"),
                          attention_dropout=m.get("attention_dropout", 0.0), decoder_sparse_step=1,
                          mlp_only_layers=[i for i in range(m["num_layers"]) if i not in moe],
                          moe_intermediate_size=expert_width(m), num_experts=m["num_experts"],
                          num_experts_per_tok=m.get("moe_top_k", 2),
                          norm_topk_prob=bool(m.get("moe_norm_topk_prob", True)),
                          router_aux_loss_coef=float(m.get("moe_aux_loss_coeff") or 0.0),
                          bos_token_id=None, eos_token_id=None, pad_token_id=None)


def model_config(config) -> dict:
    """The megand ``model`` config of a ``Qwen3MoeConfig``; ValueError for what megand does not implement."""
    if getattr(config, "attention_bias", False):
        raise ValueError("attention_bias=true: Qwen3 then has a bias on o_proj too; megand's qkv_bias covers "
                         "q/k/v only")
    m = llama_like_config(config)
    return dict(m, qk_norm=True, num_experts=config.num_experts, moe_top_k=config.num_experts_per_tok,
                moe_ffn_hidden_size=config.moe_intermediate_size, moe_shared_experts=0, moe_router="softmax",
                moe_norm_topk_prob=bool(config.norm_topk_prob), moe_layer_freq=_layer_freq(config),
                moe_aux_loss_coeff=float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0))


def rules(m: dict) -> list[Rule]:
    return moe_model_rules(m)  # no shared experts


FAMILY = Family("qwen3_moe", "Qwen3MoeForCausalLM",
                expresses={**LLAMA_SHAPE, **ATTENTION, "qk_norm": None, "sliding_window": EVERY_LAYER, **QWEN_MOE},
                marks=LLAMA_MARKS | {"qk_norm", "num_experts"},
                reads=LLAMA_LIKE_READS | QWEN_WINDOW_READS | QWEN_MOE_READS | {"attention_bias", "num_local_experts"},
                ignores=DROPOUT | {"output_router_logits"},  # a forward option (returns the router's logits)
                hf_config=hf_config, model_config=model_config, rules=rules)
