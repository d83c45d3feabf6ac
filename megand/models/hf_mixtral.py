"""State-dict adapter: megand LLaMA-style MoE models <-> ``transformers`` ``MixtralForCausalLM``.

Mixtral is a LLaMA with every MLP replaced by ``num_local_experts`` SwiGLU experts behind a softmax
router whose top-k probabilities are renormalised (megand: ``moe_router=softmax``,
``moe_norm_topk_prob=true``, no shared experts, ``moe_layer_freq=1``). The files hold the published
layout (what ``save_pretrained`` writes and Mistral's checkpoints use): per layer
``block_sparse_moe.gate`` (megand's ``mlp.router``) and per expert ``w1`` (gate), ``w3`` (up) and ``w2``
(down), which stack into megand's ``mlp.experts.fc1`` ``[E, 2f, h]`` and ``fc2`` ``[E, h, f]``.
"""

from __future__ import annotations

from megand.models.hf import Family, Rule, dims, experts_fc1_rule, experts_fc2_rule, norm_eps
from megand.models.hf_llama import (ATTENTION, DROPOUT, LLAMA_LIKE_READS, LLAMA_MARKS, LLAMA_SHAPE, attention_rules,
                                    embedding_rules, llama_like_config, rope_parameters)

# routed experts behind a softmax router with renormalised top-k, every layer MoE, no shared experts: the schema's
# MoE defaults, so Mixtral expresses only the experts' number, width and top-k
MOE = dict.fromkeys(("num_experts", "moe_top_k", "moe_ffn_hidden_size"))


def expert_width(m) -> int:
    return m.get("moe_ffn_hidden_size") or m["ffn_hidden_size"]


def hf_config(m: dict):
    from transformers import MixtralConfig

    h, heads, groups, hd = dims(m)
    return MixtralConfig(vocab_size=m["vocab_size"], hidden_size=h, intermediate_size=expert_width(m),
                         num_hidden_layers=m["num_layers"], num_attention_heads=heads, num_key_value_heads=groups,
                         head_dim=hd, hidden_act="silu", max_position_embeddings=m["seq_length"],
                         initializer_range=m.get("init_std", 0.02), rms_norm_eps=norm_eps(m),
                         rope_parameters=rope_parameters(m),
                         tie_word_embeddings=bool(m["tie_embeddings"]), sliding_window=None,
                         attention_dropout=m.get("attention_dropout", 0.0),
                         num_local_experts=m["num_experts"], num_experts_per_tok=m.get("moe_top_k", 2),
                         router_aux_loss_coef=float(m.get("moe_aux_loss_coeff") or 0.0), router_jitter_noise=0.0,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)


def model_config(config) -> dict:
    """The megand ``model`` config of a ``MixtralConfig``; ValueError for what megand does not implement."""
    m = llama_like_config(config)
    window = getattr(config, "sliding_window", None)
    if window is not None and window < config.max_position_embeddings:
        raise ValueError(f"sliding_window={window} < max_position_embeddings={config.max_position_embeddings}: "
                         "megand attends over the whole sequence")
    if getattr(config, "router_jitter_noise", 0.0):
        raise ValueError(f"router_jitter_noise={config.router_jitter_noise}: not supported")
    return dict(m, num_experts=config.num_local_experts, moe_top_k=config.num_experts_per_tok,
                moe_ffn_hidden_size=config.intermediate_size, moe_shared_experts=0, moe_router="softmax",
                moe_norm_topk_prob=True, moe_layer_freq=1,
                moe_aux_loss_coeff=float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0))


def rules(m: dict) -> list[Rule]:
    first, last = embedding_rules(m)
    out = first
    experts = range(m["num_experts"])
    for i in range(m["num_layers"]):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        moe = q + "block_sparse_moe."
        out += attention_rules(m, p, q) + [
            Rule(p + "mlp.router.weight", (moe + "gate.weight",)),
            experts_fc1_rule(p + "mlp.experts.fc1.weight", [f"{moe}experts.{e}.w1.weight" for e in experts],
                             [f"{moe}experts.{e}.w3.weight" for e in experts]),
            experts_fc2_rule(p + "mlp.experts.fc2.weight", [f"{moe}experts.{e}.w2.weight" for e in experts]),
        ]
    return out + last


FAMILY = Family("mixtral", "MixtralForCausalLM", expresses={**LLAMA_SHAPE, **ATTENTION, **MOE},
                marks=LLAMA_MARKS | {"num_experts"},
                reads=LLAMA_LIKE_READS | {"sliding_window", "router_jitter_noise", "num_local_experts",
                                          "num_experts_per_tok", "router_aux_loss_coef"},
                ignores=DROPOUT | {"output_router_logits"},  # a forward option (returns the router's logits)
                hf_config=hf_config, model_config=model_config, rules=rules)
