"""State-dict adapter: megand models with multi-head latent attention <-> ``transformers``
``DeepseekV3ForCausalLM`` (DeepSeek-V3, Kimi-K2, Moonlight). Kimi-K2's config.json says ``model_type: kimi_k2``
(for its own code, which transformers does not have): import reads it as DeepSeek-V3's config (the family's
``aliases``); export writes ``deepseek_v3``, which transformers loads.

Attention: ``q_a_proj``/``q_a_layernorm``/``q_b_proj`` (or ``q_proj`` with ``q_lora_rank`` null) are megand's
``attention.q_down``/``q_down_norm``/``q_up``; ``kv_a_proj_with_mqa``/``kv_a_layernorm``/``kv_b_proj`` its
``kv_down``/``kv_down_norm``/``kv_up``. DeepSeek's published weights rotate interleaved pairs of the RoPE
dimensions (``rope_interleave=true``); megand rotates halves, which is the same rotation once each head's
RoPE rows are reordered (even rows first, then odd): import reorders, export writes them back interleaved.

MoE layers: the sigmoid router (``mlp.gate``, its ``e_score_correction_bias`` is megand's ``expert_bias``),
group-limited top-k (``n_group``/``topk_group``), ``routed_scaling_factor``, the routed experts and
``n_shared_experts`` ungated shared experts; the first ``first_k_dense_replace`` layers are dense MLPs of
``intermediate_size``. A model without experts is written with every layer dense.

Multi-token prediction: ``num_nextn_predict_layers`` modules stored after the main model's layers (DeepSeek's
``model.layers.{num_hidden_layers + k}.*``, which transformers' model class does not read) are megand's
``model.mtp_layers`` depths, both ways (:func:`rules`).
"""

from __future__ import annotations

import torch

from megand.models.hf import Family, Rule, When, equals, experts_fc1_rule, experts_fc2_rule, is_moe_layer, norm_eps
from megand.models.hf_llama import DROPOUT, LLAMA_MARKS, LLAMA_SHAPE, mlp_rules, rope_keys, rope_parameters

# its experts: the sigmoid router with ungated shared experts, group-limited routing, the first layers dense
DEEPSEEK_MOE = When("model.moe_router=sigmoid and model.moe_shared_experts > 0",
                    lambda m: m.get("moe_router") == "sigmoid" and (m.get("moe_shared_experts") or 0) > 0)
EXPRESSES = {**LLAMA_SHAPE, **dict.fromkeys(("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                             "v_head_dim", "mtp_layers")),
             "num_experts": DEEPSEEK_MOE, "moe_router": equals("moe_router", "sigmoid"),
             **dict.fromkeys(("moe_top_k", "moe_ffn_hidden_size", "moe_shared_experts", "moe_norm_topk_prob",
                              "moe_n_group", "moe_topk_group", "moe_routed_scaling_factor",
                              "moe_first_k_dense_replace"))}
# config.json keys of DeepSeek's published files that transformers' class does not read but that would change the
# model: read, and refused where they differ from what that class (and megand) computes
PUBLISHED = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}


def _interleaved_order(rope: int) -> torch.Tensor:
    """megand's row i of a head's RoPE rows is DeepSeek's row ``order[i]`` (evens, then odds)."""
    return torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])


def _reorder_rope_rows(t: torch.Tensor, unit: int, rope: int, inverse: bool) -> torch.Tensor:
    """Reorder the last ``rope`` rows of every ``unit``-row block of ``t`` (a head, or the kv down projection)."""
    order = _interleaved_order(rope)
    if inverse:
        order = torch.argsort(order)
    blocks = t.reshape(-1, unit, *t.shape[1:])
    if t.is_meta:
        return t
    rows = torch.cat([blocks[:, : unit - rope], blocks[:, unit - rope:][:, order]], dim=1)
    return rows.reshape(t.shape)


def _rope_rule(megand: str, hf: str, unit: int, rope: int) -> Rule:
    return Rule(megand, (hf,), lambda t: (_reorder_rope_rows(t, unit, rope, inverse=True),),
                lambda t: _reorder_rope_rows(t, unit, rope, inverse=False))


def sigmoid_moe_hf_keys(m: dict) -> dict:
    """The transformers config arguments of a DeepSeek-V3-style MoE (the inverse of :func:`with_sigmoid_moe`);
    for a dense model, one routed expert and every layer dense (the other values are the configs' defaults)."""
    if not m.get("num_experts"):
        return dict(n_routed_experts=1, num_experts_per_tok=1, n_shared_experts=1, n_group=1, topk_group=1,
                    first_k_dense_replace=m["num_layers"])
    return dict(n_routed_experts=m["num_experts"], num_experts_per_tok=m.get("moe_top_k", 2),
                moe_intermediate_size=m.get("moe_ffn_hidden_size") or m["ffn_hidden_size"],
                n_shared_experts=m["moe_shared_experts"], n_group=m.get("moe_n_group") or 1,
                topk_group=m.get("moe_topk_group") or 1,
                routed_scaling_factor=float(m.get("moe_routed_scaling_factor", 1.0)),
                norm_topk_prob=bool(m.get("moe_norm_topk_prob", True)),
                first_k_dense_replace=int(m.get("moe_first_k_dense_replace") or 0))


def hf_config(m: dict):
    from transformers import DeepseekV3Config

    routing = sigmoid_moe_hf_keys(m)
    return DeepseekV3Config(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"],
                            intermediate_size=m["ffn_hidden_size"], num_hidden_layers=m["num_layers"],
                            num_attention_heads=m["num_attention_heads"], num_key_value_heads=m["num_attention_heads"],
                            q_lora_rank=m.get("q_lora_rank"), kv_lora_rank=m["kv_lora_rank"],
                            qk_nope_head_dim=m["qk_nope_head_dim"], qk_rope_head_dim=m["qk_rope_head_dim"],
                            v_head_dim=m["v_head_dim"], hidden_act="silu", max_position_embeddings=m["seq_length"],
                            initializer_range=m.get("init_std", 0.02), rms_norm_eps=norm_eps(m),
                            rope_parameters=rope_parameters(m), rope_interleave=True,
                            tie_word_embeddings=bool(m["tie_embeddings"]), attention_bias=False,
                            attention_dropout=m.get("attention_dropout", 0.0),
                            num_nextn_predict_layers=int(m.get("mtp_layers") or 0),
                            bos_token_id=None, eos_token_id=None, pad_token_id=None, **routing)


def model_config(config) -> dict:
    """The megand ``model`` config of a ``DeepseekV3Config``; ValueError for what megand does not implement."""
    if getattr(config, "attention_bias", False):
        raise ValueError("attention_bias=true: megand's latent attention has no biases")
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r}: megand's SwiGLU uses silu")
    if getattr(config, "rope_interleave", True) is False:
        raise ValueError("rope_interleave=false: the adapter reads DeepSeek's interleaved RoPE rows only")
    for key, value in PUBLISHED.items():
        if getattr(config, key, value) != value:
            raise ValueError(f"{key}={getattr(config, key)!r}: DeepSeek-V3's model (and megand's) has {key}={value!r}")
    L = config.num_hidden_layers
    m = dict(**rope_keys(config), arch="llama", num_layers=L, hidden_size=config.hidden_size,
             ffn_hidden_size=config.intermediate_size, num_attention_heads=config.num_attention_heads,
             q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
             qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
             v_head_dim=config.v_head_dim, seq_length=config.max_position_embeddings, vocab_size=config.vocab_size,
             norm="rmsnorm", norm_eps=float(config.rms_norm_eps), activation="swiglu", position_embedding="rope",
             tie_embeddings=bool(config.tie_word_embeddings), init_std=config.initializer_range,
             hidden_dropout=0.0, attention_dropout=0.0,
             mtp_layers=int(getattr(config, "num_nextn_predict_layers", 0) or 0))
    return with_sigmoid_moe(m, config)


def with_sigmoid_moe(m: dict, config) -> dict:
    """``m`` with the MoE keys of a DeepSeek-V3-style config (a sigmoid router with a correction bias, groups,
    shared experts, the first layers dense); ``m`` as is when every layer is dense."""
    first_dense = config.first_k_dense_replace or 0
    if first_dense >= config.num_hidden_layers:  # every layer dense
        return m
    grouped = (config.n_group or 1) > 1
    return dict(m, num_experts=config.n_routed_experts, moe_top_k=config.num_experts_per_tok,
                moe_ffn_hidden_size=config.moe_intermediate_size, moe_shared_experts=config.n_shared_experts,
                moe_router="sigmoid", moe_norm_topk_prob=bool(config.norm_topk_prob),
                moe_n_group=config.n_group if grouped else None, moe_topk_group=config.topk_group if grouped else None,
                moe_routed_scaling_factor=float(config.routed_scaling_factor),
                moe_first_k_dense_replace=first_dense, moe_layer_freq=1, moe_aux_loss_coeff=0.0)


def mtp_marker(m: dict) -> str:
    """A tensor that files holding DeepSeek's multi-token prediction module have (the first depth's projection)."""
    return f"model.layers.{m['num_layers']}.eh_proj.weight"


def _copies_rule(megand: str, names: list[str]) -> Rule:
    """One megand tensor written as several identical HF tensors (DeepSeek's files repeat the word embedding and
    the output layer in every multi-token prediction module); import refuses copies that differ."""
    def from_hf(first, *copies):
        for name, copy in zip(names[1:], copies):
            if not torch.equal(copy, first):
                raise ValueError(f"{name} differs from {names[0]}: megand's multi-token prediction shares the word "
                                 f"embedding and the output layer with the main model")
        return first

    return Rule(megand, tuple(names), lambda t: tuple(t for _ in names), from_hf)


def rules(m: dict, rope_interleave: bool = True) -> list[Rule]:
    """``rope_interleave``: the files' RoPE rows interleaved (DeepSeek's layout, and what export writes)."""
    return mtp_model_rules(m, lambda p, q, moe: _layer_rules(m, p, q, moe, rope_interleave))


def mtp_model_rules(m: dict, layer_rules) -> list[Rule]:
    """The rules of a model in DeepSeek-V3's file layout whose transformer layers ``layer_rules(megand prefix,
    files' prefix, moe)`` gives (GLM-4.5 shares the layout with its own attention).

    Multi-token prediction depth k (``model.mtp_layers``) is DeepSeek's module ``model.layers.{num_layers + k}``:
    ``enorm``, ``hnorm``, ``eh_proj`` (megand's ``proj``, the embedding half first), a transformer layer under
    the same names as the main model's (MoE or dense by the same rule), ``shared_head.norm`` (megand's
    ``final_norm``) and copies of the word embedding (``embed_tokens``) and of the output layer
    (``shared_head.head``), which megand shares with the main model."""
    L, depths = m["num_layers"], m.get("mtp_layers") or 0
    mtp = [f"model.layers.{L + k}." for k in range(depths)]
    embedding = ["model.embed_tokens.weight"] + [q + "embed_tokens.weight" for q in mtp]
    heads = [q + "shared_head.head.weight" for q in mtp]
    out = []
    if m["tie_embeddings"]:
        out.append(_copies_rule("embedding.word.weight", embedding + heads))
    else:
        out.append(_copies_rule("embedding.word.weight", embedding))
    for i in range(L):
        out += layer_rules(f"layers.{i}.", f"model.layers.{i}.", is_moe_layer(m, i))
    out.append(Rule("final_norm.weight", ("model.norm.weight",)))
    if not m["tie_embeddings"]:
        out.append(_copies_rule("output_layer.weight", ["lm_head.weight"] + heads))
    for k, q in enumerate(mtp):
        p = f"mtp.depths.{k}."
        out += [Rule(p + "enorm.weight", (q + "enorm.weight",)), Rule(p + "hnorm.weight", (q + "hnorm.weight",)),
                Rule(p + "proj.weight", (q + "eh_proj.weight",)),
                *layer_rules(p + "layer.", q, is_moe_layer(m, L + k)),
                Rule(p + "final_norm.weight", (q + "shared_head.norm.weight",))]
    return out


def _layer_rules(m: dict, p: str, q: str, moe: bool, rope_interleave: bool) -> list[Rule]:
    """One transformer layer: megand's prefix ``p`` <-> the files' prefix ``q``."""
    rope, r = m["qk_rope_head_dim"], m["kv_lora_rank"]
    unit = m["qk_nope_head_dim"] + rope

    def rope_rows(megand, hf, unit):
        return _rope_rule(megand, hf, unit, rope) if rope_interleave else Rule(megand, (hf,))

    a, qa = p + "attention.", q + "self_attn."
    if m.get("q_lora_rank") is None:
        out = [rope_rows(a + "q_up.weight", qa + "q_proj.weight", unit)]
    else:
        out = [Rule(a + "q_down", (qa + "q_a_proj.weight",)),
               Rule(a + "q_down_norm.weight", (qa + "q_a_layernorm.weight",)),
               rope_rows(a + "q_up.weight", qa + "q_b_proj.weight", unit)]
    out += [rope_rows(a + "kv_down", qa + "kv_a_proj_with_mqa.weight", r + rope),
            Rule(a + "kv_down_norm.weight", (qa + "kv_a_layernorm.weight",)),
            Rule(a + "kv_up.weight", (qa + "kv_b_proj.weight",)),
            Rule(a + "proj.weight", (qa + "o_proj.weight",)),
            Rule(p + "input_norm.weight", (q + "input_layernorm.weight",)),
            Rule(p + "post_attention_norm.weight", (q + "post_attention_layernorm.weight",))]
    return out + (deepseek_moe_rules(m, p, q) if moe else mlp_rules(p + "mlp.", q + "mlp."))


def deepseek_moe_rules(m: dict, p: str, q: str) -> list[Rule]:
    """A MoE layer's MLP: the sigmoid router with its correction bias, the routed experts, the shared experts."""
    mlp, experts = q + "mlp.", range(m["num_experts"])
    return [Rule(p + "mlp.router.weight", (mlp + "gate.weight",)),
            Rule(p + "mlp.router.expert_bias", (mlp + "gate.e_score_correction_bias",)),
            experts_fc1_rule(p + "mlp.experts.fc1.weight", [f"{mlp}experts.{e}.gate_proj.weight" for e in experts],
                             [f"{mlp}experts.{e}.up_proj.weight" for e in experts]),
            experts_fc2_rule(p + "mlp.experts.fc2.weight", [f"{mlp}experts.{e}.down_proj.weight" for e in experts]),
            *mlp_rules(p + "mlp.shared_experts.", mlp + "shared_experts.")]


FAMILY = Family("deepseek_v3", "DeepseekV3ForCausalLM", expresses=EXPRESSES, marks=LLAMA_MARKS | {"kv_lora_rank"},
                reads=frozenset({
                    "attention_bias", "hidden_act", "rope_interleave", "rope_parameters", "rope_theta", "rope_scaling",
                    "partial_rotary_factor", "num_hidden_layers", "hidden_size", "intermediate_size",
                    "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                    "v_head_dim", "max_position_embeddings", "vocab_size", "rms_norm_eps", "tie_word_embeddings",
                    "initializer_range", "num_nextn_predict_layers", "first_k_dense_replace", "n_group", "topk_group",
                    "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                    "routed_scaling_factor", "norm_topk_prob", *PUBLISHED}),
                # head_dim, qk_head_dim: derived (the rope and the nope + rope widths); num_key_value_heads: keys and
                # values come per head from the latent (DeepseekV3Config's default is 128 whatever the heads);
                # pretraining_tp: unread by transformers; ep_size, seq_aux, aux_loss_alpha: DeepSeek's training
                # (layout, auxiliary loss); auto_map: DeepSeek's own code, which transformers' class replaces
                ignores=DROPOUT | {"head_dim", "qk_head_dim", "num_key_value_heads", "pretraining_tp",
                                   "output_router_logits", "ep_size", "seq_aux", "aux_loss_alpha", "auto_map"},
                hf_config=hf_config, model_config=model_config, rules=rules, mtp_marker=mtp_marker,
                # Kimi-K2's files: DeepSeek-V3's architecture, config.json with model_type kimi_k2 and DeepSeek's keys
                aliases=frozenset({"kimi_k2"}))
