"""State-dict adapter: megand hybrid Gated DeltaNet / attention models <-> ``transformers``
``Qwen3NextForCausalLM`` (Qwen3-Next; dense with ``num_experts=0``, else MoE with a gated shared expert).

``layer_types`` (``linear_attention`` | ``full_attention``, three of the first per one of the second in the
published models) is megand's ``model.layer_types`` (``linear_attention`` | ``attention``). The full attention
is Qwen3's (per-head q/k RMSNorms, a head width of its own) with an output gate (``q_proj`` holds per head its
queries then its gate: megand's ``attention_output_gate``, the gates stored in the fused QKV after each query
group's queries) and partial rotary (``partial_rotary_factor``). Every RMSNorm but the linear attention's
gated one scales by ``1 + w`` (``norm_unit_offset``). The linear attention (megand's
:class:`~megand.core.transformer.gated_deltanet.GatedDeltaNet`) maps one to one, but for its convolution:
transformers orders the channels all queries, all keys, all values; megand per key head (its queries, key,
values), so that a tensor-parallel split gives whole heads. MoE layers are Qwen2-MoE's (softmax router, a
shared expert behind ``sigmoid(shared_expert_gate(x))``). A dense Qwen3-Next imports; a dense model exports
as Qwen3.5 (``hf_qwen3_5_text``: the same maths, the published dense family).
"""

from __future__ import annotations

import types

import torch

from megand.core.transformer.attention import fuse_qkv, split_qkv
from megand.models.hf import Family, Rule, When, dims, equals, experts_fc1_rule, experts_fc2_rule, moe_layer_ids, norm_eps
from megand.models.hf_llama import (ATTENTION, DROPOUT, LLAMA_LIKE_READS, LLAMA_MARKS, LLAMA_SHAPE, embedding_rules,
                                    llama_like_config, mlp_rules, rope_parameters)
from megand.models.hf_qwen2_moe import QWEN_MOE, QWEN_MOE_READS, _layer_freq, expert_width

# the linear attention's head counts and widths: the same names in megand's model and transformers' config
LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
TYPES = {"attention": "full_attention", "linear_attention": "linear_attention"}  # megand -> transformers


def _types(m) -> list[str]:
    return list(m.get("layer_types") or ["attention"] * m["num_layers"])


def hybrid_hf_kwargs(m: dict) -> dict:
    """The transformers config arguments a Qwen3-Next and a Qwen3.5 text model share (all but the MoE ones)."""
    h, heads, groups, hd = dims(m)
    rope = dict(rope_parameters(m), partial_rotary_factor=float(m.get("partial_rotary_factor", 1.0)))
    return dict(
        vocab_size=m["vocab_size"], hidden_size=h, intermediate_size=m["ffn_hidden_size"],
        num_hidden_layers=m["num_layers"], num_attention_heads=heads, num_key_value_heads=groups, head_dim=hd,
        hidden_act="silu", max_position_embeddings=m["seq_length"], initializer_range=m.get("init_std", 0.02),
        rms_norm_eps=norm_eps(m), rope_parameters=rope, tie_word_embeddings=bool(m["tie_embeddings"]),
        attention_bias=False, attention_dropout=m.get("attention_dropout", 0.0),
        layer_types=[TYPES[t] for t in _types(m)], linear_conv_kernel_dim=m.get("linear_conv_kernel", 4),
        **{k: m[k] for k in LINEAR_KEYS if k in m}, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def hf_config(m: dict):
    from transformers import Qwen3NextConfig

    moe = set(moe_layer_ids(m))
    experts = m.get("num_experts") or 0
    return Qwen3NextConfig(
        **hybrid_hf_kwargs(m), decoder_sparse_step=1, mlp_only_layers=[i for i in range(m["num_layers"]) if i not in moe],
        num_experts=experts, moe_intermediate_size=expert_width(m) if experts else 0,
        shared_expert_intermediate_size=(m.get("moe_shared_experts") or 0) * expert_width(m) if experts else 0,
        num_experts_per_tok=m.get("moe_top_k", 2), norm_topk_prob=bool(m.get("moe_norm_topk_prob", True)),
        router_aux_loss_coef=float(m.get("moe_aux_loss_coeff") or 0.0))


def hybrid_config(config) -> dict:
    """The megand ``model`` keys of a Qwen3-Next / Qwen3.5 config but the MoE ones; ValueError for what megand
    does not implement."""
    if getattr(config, "attention_bias", False):
        raise ValueError("attention_bias=true: megand's gated attention has no biases")
    rope = dict(getattr(config, "rope_parameters", None) or {})
    partial = float(rope.pop("partial_rotary_factor", None) or getattr(config, "partial_rotary_factor", None) or 1.0)
    # the LLaMA-family keys, the partial rotary taken off (megand has it as its own key)
    plain = types.SimpleNamespace(**{**config.to_dict(), "rope_parameters": rope, "partial_rotary_factor": None,
                                     "use_sliding_window": False})
    unknown = sorted(set(config.layer_types) - set(TYPES.values()))
    if unknown:
        raise ValueError(f"layer_types holds {unknown[0]!r}: megand's layers have full or linear attention")
    out = dict(llama_like_config(plain), qk_norm=True, attention_output_gate=True, partial_rotary_factor=partial,
               norm_unit_offset=True, layer_types=["attention" if t == "full_attention" else t for t in config.layer_types],
               linear_conv_kernel=config.linear_conv_kernel_dim, **{k: getattr(config, k) for k in LINEAR_KEYS})
    return out


def model_config(config) -> dict:
    """The megand ``model`` config of a ``Qwen3NextConfig``; ValueError for what megand does not implement."""
    out = hybrid_config(config)
    if config.num_experts:
        f, shared = config.moe_intermediate_size, config.shared_expert_intermediate_size
        if not shared or shared % f:
            raise ValueError(f"shared_expert_intermediate_size={shared} is not a positive multiple of "
                             f"moe_intermediate_size={f} (megand's shared experts are moe_shared_experts x {f} wide)")
        out.update(num_experts=config.num_experts, moe_top_k=config.num_experts_per_tok, moe_ffn_hidden_size=f,
                   moe_shared_experts=shared // f, moe_shared_expert_gate=True, moe_router="softmax",
                   moe_norm_topk_prob=bool(config.norm_topk_prob), moe_layer_freq=_layer_freq(config),
                   moe_aux_loss_coeff=float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0))
    return out


def gated_qkv_rule(m: dict, p: str, q: str) -> Rule:
    """The fused QKV with output gates (per query group: its queries, their gates, its key, its value) <->
    ``q_proj`` (per head: its query, then its gate), ``k_proj``, ``v_proj``."""
    _, heads, groups, d = dims(m)

    def to_hf(t):
        qg, k, v = split_qkv(t, 2 * heads, groups)
        qg = qg.reshape(groups, 2, heads // groups, d, -1)  # [groups, (queries | gates), heads per group, d, h]
        return qg.permute(0, 2, 1, 3, 4).reshape(2 * heads * d, -1), k, v

    def from_hf(wq, wk, wv):
        qg = wq.reshape(groups, heads // groups, 2, d, -1).permute(0, 2, 1, 3, 4).reshape(2 * heads * d, -1)
        return fuse_qkv(qg, wk, wv, groups)

    names = tuple(q + f"self_attn.{x}_proj.weight" for x in "qkv")
    return Rule(p + "attention.qkv.weight", names, to_hf, from_hf)


def conv_rule(m: dict, p: str, q: str) -> Rule:
    """The convolution's taps: megand ``[C, K]`` per key head (queries, key, values) <-> ``[C, 1, K]`` all
    queries, all keys, all values."""
    G, dk, dv = m["linear_num_key_heads"], m["linear_key_head_dim"], m["linear_value_head_dim"]
    rdv = m["linear_num_value_heads"] // G * dv

    def to_hf(t):
        K = t.shape[-1]
        qkv = t.reshape(G, 2 * dk + rdv, K)
        parts = qkv.split([dk, dk, rdv], dim=1)
        return (torch.cat([x.reshape(-1, K) for x in parts]).unsqueeze(1),)

    def from_hf(w):
        K = w.shape[-1]
        qh, kh, vh = w.reshape(-1, K).split([G * dk, G * dk, G * rdv])
        return torch.cat([qh.reshape(G, dk, K), kh.reshape(G, dk, K), vh.reshape(G, rdv, K)], dim=1).reshape(-1, K)

    return Rule(p + "attention.conv", (q + "linear_attn.conv1d.weight",), to_hf, from_hf)


def linear_rules(m: dict, p: str, q: str) -> list[Rule]:
    """A Gated DeltaNet layer's projections as Qwen3-Next stores them: per key head, like megand's."""
    a = q + "linear_attn."
    return [Rule(p + "attention.qkvz.weight", (a + "in_proj_qkvz.weight",)),
            Rule(p + "attention.ba.weight", (a + "in_proj_ba.weight",))]


def rules(m: dict, linear=linear_rules) -> list[Rule]:
    """Every tensor's rule; ``linear(m, p, q)``: the rules of a Gated DeltaNet layer's in-projections."""
    first, last = embedding_rules(m)
    out = first
    moe, kinds = set(moe_layer_ids(m)), _types(m)
    for i in range(m["num_layers"]):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        if kinds[i] == "linear_attention":
            a = q + "linear_attn."
            out += [*linear(m, p, q), conv_rule(m, p, q),
                    Rule(p + "attention.a_log", (a + "A_log",)), Rule(p + "attention.dt_bias", (a + "dt_bias",)),
                    Rule(p + "attention.norm.weight", (a + "norm.weight",)),
                    Rule(p + "attention.proj.weight", (a + "out_proj.weight",))]
        else:
            out += [gated_qkv_rule(m, p, q),
                    Rule(p + "attention.q_norm.weight", (q + "self_attn.q_norm.weight",)),
                    Rule(p + "attention.k_norm.weight", (q + "self_attn.k_norm.weight",)),
                    Rule(p + "attention.proj.weight", (q + "self_attn.o_proj.weight",))]
        out += [Rule(p + "input_norm.weight", (q + "input_layernorm.weight",)),
                Rule(p + "post_attention_norm.weight", (q + "post_attention_layernorm.weight",))]
        if i not in moe:
            out += mlp_rules(p + "mlp.", q + "mlp.")
            continue
        mlp, experts = q + "mlp.", range(m["num_experts"])
        out += [Rule(p + "mlp.router.weight", (mlp + "gate.weight",)),
                experts_fc1_rule(p + "mlp.experts.fc1.weight", [f"{mlp}experts.{e}.gate_proj.weight" for e in experts],
                                 [f"{mlp}experts.{e}.up_proj.weight" for e in experts]),
                experts_fc2_rule(p + "mlp.experts.fc2.weight", [f"{mlp}experts.{e}.down_proj.weight" for e in experts]),
                *mlp_rules(p + "mlp.shared_experts.", mlp + "shared_expert."),
                Rule(p + "mlp.shared_experts.gate.weight", (mlp + "shared_expert_gate.weight",))]
    return out + last


# Qwen3-Next's MoE layers always have their gated shared expert
GATED_SHARED = When("model.moe_shared_experts > 0 and model.moe_shared_expert_gate=true",
                    lambda m: not m.get("num_experts") or (m.get("moe_shared_experts") and m.get("moe_shared_expert_gate")))

FAMILY = Family(
    "qwen3_next", "Qwen3NextForCausalLM",
    expresses={**LLAMA_SHAPE, **ATTENTION, "qk_norm": equals("qk_norm", True),
               "attention_output_gate": equals("attention_output_gate", True), "partial_rotary_factor": None,
               "norm_unit_offset": equals("norm_unit_offset", True), "layer_types": None, "linear_conv_kernel": None,
               **dict.fromkeys(LINEAR_KEYS), **QWEN_MOE, "num_experts": GATED_SHARED, "moe_shared_experts": None,
               "moe_shared_expert_gate": None},
    # dense models with these keys export as Qwen3.5 (hf_qwen3_5_text: the same maths); Qwen3-Next's are MoE
    marks=LLAMA_MARKS | {"qk_norm", "attention_output_gate", "norm_unit_offset", "layer_types", "num_experts"},
    reads=(LLAMA_LIKE_READS | QWEN_MOE_READS | {"attention_bias", "layer_types", "linear_conv_kernel_dim",
                                                "shared_expert_intermediate_size", *LINEAR_KEYS}),
    ignores=DROPOUT | {"output_router_logits"},  # a forward option (returns the router's logits)
    hf_config=hf_config, model_config=model_config, rules=rules)
