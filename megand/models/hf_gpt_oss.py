"""State-dict adapter: megand models <-> ``transformers`` ``GptOssForCausalLM`` (OpenAI's gpt-oss-20b, gpt-oss-120b).

GPT-OSS is the LLaMA layout with: attention sinks (``self_attn.sinks``, one logit per head in each softmax's
denominator: megand's ``attention_sinks``), biases on q/k/v and on ``o_proj`` (``attention_bias``: megand's
``qkv_bias`` and ``attention_out_bias``, together), sliding-window and full layers alternating by ``layer_types``
under one YaRN RoPE (:mod:`megand.models.hf_local_global`'s windows), and every MLP a MoE: a router with a bias
(softmax over the top-k logits, which is megand's softmax router with renormalised top-k) and experts with
biases (``moe_bias``) and GPT-OSS's clamped SwiGLU (``swiglu_limit``, ``swiglu_alpha``). Its experts are stored
fused: ``gate_up_proj [E, h, 2f]`` with gate and up interleaved along the last dim (megand's ``fc1 [E, 2f, h]``
transposed, the same interleaving), ``down_proj [E, f, h]`` (``fc2`` transposed), and their biases as they are.
"""

from __future__ import annotations

import types

from megand.models import hf_local_global as lg
from megand.models.hf import Family, Rule, When, dims, equals, norm_eps
from megand.models.hf_llama import (ATTENTION, DROPOUT, LLAMA_LIKE_READS, LLAMA_MARKS, LLAMA_SHAPE, attention_rules,
                                    embedding_rules, llama_like_config, rope_parameters)
from megand.models.hf_mixtral import expert_width

BIASES = When("model.qkv_bias equal to model.attention_out_bias (attention_bias: all four projections)",
              lambda m: bool(m.get("qkv_bias")) == bool(m.get("attention_out_bias")))
MARKS = LLAMA_MARKS | {"attention_sinks", "num_experts", "moe_bias", "swiglu_limit"}
EXPRESSES = {**LLAMA_SHAPE, **ATTENTION, "attention_sinks": equals("attention_sinks", True), "qkv_bias": BIASES,
             "attention_out_bias": BIASES, "sliding_window": lg.ONE_WINDOW_SIZE, "moe_bias": equals("moe_bias", True),
             **dict.fromkeys(("num_experts", "moe_top_k", "moe_ffn_hidden_size", "swiglu_limit", "swiglu_alpha"))}


def hf_config(m: dict):
    from transformers import GptOssConfig

    h, heads, groups, hd = dims(m)
    windows = lg.layer_types(m)
    # transformers' model builds the sliding mask whatever the layers: a window no layer uses, the whole context
    windows["sliding_window"] = windows["sliding_window"] or m["seq_length"]
    return GptOssConfig(vocab_size=m["vocab_size"], hidden_size=h, intermediate_size=expert_width(m),
                        num_hidden_layers=m["num_layers"], num_attention_heads=heads, num_key_value_heads=groups,
                        head_dim=hd, hidden_act="silu", max_position_embeddings=m["seq_length"],
                        initializer_range=m.get("init_std", 0.02), rms_norm_eps=norm_eps(m),
                        rope_parameters=rope_parameters(m), tie_word_embeddings=bool(m["tie_embeddings"]),
                        attention_bias=bool(m.get("qkv_bias")), attention_dropout=m.get("attention_dropout", 0.0),
                        num_local_experts=m["num_experts"], num_experts_per_tok=m.get("moe_top_k", 2),
                        swiglu_limit=float(m["swiglu_limit"]), swiglu_alpha=float(m.get("swiglu_alpha", 1.702)),
                        router_aux_loss_coef=float(m.get("moe_aux_loss_coeff") or 0.0), **windows,
                        bos_token_id=None, eos_token_id=None, pad_token_id=None)


def model_config(config) -> dict:
    """The megand ``model`` config of a ``GptOssConfig``; ValueError naming what megand does not implement."""
    if config.swiglu_limit is None:
        raise ValueError("swiglu_limit=None: megand's GPT-OSS experts have the clamped SwiGLU (a limit > 0)")
    # hidden_act: GPT-OSS's experts apply their own SwiGLU, whatever it says
    plain = types.SimpleNamespace(**{**config.to_dict(), "use_sliding_window": False, "hidden_act": "silu"})
    bias = bool(config.attention_bias)
    return dict(llama_like_config(plain), sliding_window=lg.windows(config), attention_sinks=True, qkv_bias=bias,
                attention_out_bias=bias, num_experts=config.num_local_experts, moe_top_k=config.num_experts_per_tok,
                moe_ffn_hidden_size=config.intermediate_size, moe_router="softmax", moe_norm_topk_prob=True,
                moe_bias=True, swiglu_limit=float(config.swiglu_limit), swiglu_alpha=float(config.swiglu_alpha),
                moe_aux_loss_coeff=float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0))


def _transposed(megand: str, hf: str) -> Rule:
    """An expert tensor stored with its last two dims swapped."""
    return Rule(megand, (hf,), lambda t: (t.transpose(1, 2).contiguous(),), lambda t: t.transpose(1, 2).contiguous())


def rules(m: dict) -> list[Rule]:
    first, last = embedding_rules(m)
    out = first
    for i in range(m["num_layers"]):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        out += attention_rules(m, p, q) + [Rule(p + "attention.sinks", (q + "self_attn.sinks",))]
        if m.get("attention_out_bias"):
            out.append(Rule(p + "attention.proj.bias", (q + "self_attn.o_proj.bias",)))
        e = q + "mlp.experts."
        out += [Rule(p + "mlp.router.weight", (q + "mlp.router.weight",)),
                Rule(p + "mlp.router.bias", (q + "mlp.router.bias",)),
                _transposed(p + "mlp.experts.fc1.weight", e + "gate_up_proj"),
                Rule(p + "mlp.experts.fc1.bias", (e + "gate_up_proj_bias",)),
                _transposed(p + "mlp.experts.fc2.weight", e + "down_proj"),
                Rule(p + "mlp.experts.fc2.bias", (e + "down_proj_bias",))]
    return out + last


FAMILY = Family("gpt_oss", "GptOssForCausalLM", expresses=EXPRESSES, marks=MARKS,
                reads=LLAMA_LIKE_READS | lg.READS | {"attention_bias", "num_local_experts", "num_experts_per_tok",
                                                     "swiglu_limit", "swiglu_alpha", "router_aux_loss_coef"},
                ignores=DROPOUT | {"output_router_logits"},  # a forward option (returns the router's logits)
                hf_config=hf_config, model_config=model_config, rules=rules)
