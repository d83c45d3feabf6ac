"""State-dict adapter: megand LLaMA-style MoE models with gated shared experts <-> ``transformers``
``Qwen2MoeForCausalLM`` (Qwen1.5-MoE, Qwen2-57B-A14B).

Qwen2-MoE is a LLaMA whose MoE layers add to the routed experts (softmax router, top-k renormalised only
with ``norm_topk_prob``) one always-on ``shared_expert`` MLP scaled by ``sigmoid(shared_expert_gate(x))``:
megand's ``moe_shared_experts`` (its width is ``moe_shared_experts * moe_ffn_hidden_size``) with
``moe_shared_expert_gate=true``. Its attention has q/k/v biases by default (``qkv_bias``, megand's
``model.qkv_bias``). Which layers are MoE: Qwen makes layer i sparse when ``(i + 1) % decoder_sparse_step
== 0`` and i is not in ``mlp_only_layers``; export writes megand's rule (i % moe_layer_freq == 0) as
``mlp_only_layers``, import accepts any config whose sparse layers follow megand's rule. Dense layers are
MLPs of ``intermediate_size`` (megand's ``ffn_hidden_size``). The files hold the published per-expert
layout (``mlp.experts.{e}.gate_proj/up_proj/down_proj``), as ``save_pretrained`` writes it.
"""

from __future__ import annotations

from megand.models.hf import Family, Rule, dims, experts_fc1_rule, experts_fc2_rule, moe_layer_ids, norm_eps
from megand.models.hf_llama import (DROPOUT, LLAMA_LIKE_READS, LLAMA_MARKS, LLAMA_SHAPE, QWEN_WINDOW_READS,
                                    attention_rules, embedding_rules, llama_like_config, mlp_rules, rope_parameters)

# the MoE keys of Qwen's softmax-routed experts (Qwen2-MoE adds its gated shared experts)
QWEN_MOE = dict.fromkeys(("num_experts", "moe_top_k", "moe_ffn_hidden_size", "moe_norm_topk_prob", "moe_layer_freq"))
# the config.json keys of Qwen's MoE layers
QWEN_MOE_READS = frozenset({"num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                            "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef"})


def expert_width(m) -> int:
    return m.get("moe_ffn_hidden_size") or m["ffn_hidden_size"]


def hf_config(m: dict):
    from transformers import Qwen2MoeConfig

    h, heads, groups, _ = dims(m)
    moe = set(moe_layer_ids(m))
    return Qwen2MoeConfig(vocab_size=m["vocab_size"], hidden_size=h, intermediate_size=m["ffn_hidden_size"],
                          num_hidden_layers=m["num_layers"], num_attention_heads=heads, num_key_value_heads=groups,
                          hidden_act="silu", max_position_embeddings=m["seq_length"],
                          initializer_range=m.get("init_std", 0.02), rms_norm_eps=norm_eps(m),
                          rope_parameters=rope_parameters(m),
                          tie_word_embeddings=bool(m["tie_embeddings"]), use_sliding_window=False,
                          attention_dropout=m.get("attention_dropout", 0.0), decoder_sparse_step=1,
                          mlp_only_layers=[i for i in range(m["num_layers"]) if i not in moe],
                          moe_intermediate_size=expert_width(m),
                          shared_expert_intermediate_size=m["moe_shared_experts"] * expert_width(m),
                          num_experts=m["num_experts"], num_experts_per_tok=m.get("moe_top_k", 2),
                          norm_topk_prob=bool(m.get("moe_norm_topk_prob", True)),
                          router_aux_loss_coef=float(m.get("moe_aux_loss_coeff") or 0.0),
                          qkv_bias=bool(m.get("qkv_bias", False)),
                          bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _layer_freq(config) -> int:
    """megand's moe_layer_freq for the sparse layers of a Qwen2-MoE config, or ValueError."""
    L, step = config.num_hidden_layers, config.decoder_sparse_step or 1
    dense = set(config.mlp_only_layers or [])
    sparse = [i for i in range(L) if i not in dense and (i + 1) % step == 0]
    freq = sparse[1] - sparse[0] if len(sparse) > 1 else L
    if not sparse or sparse != list(range(0, L, freq)):
        raise ValueError(f"sparse layers {sparse} (decoder_sparse_step={step}, mlp_only_layers={sorted(dense)}): "
                         "megand makes layer i MoE when i % moe_layer_freq == 0")
    return freq


def model_config(config) -> dict:
    """The megand ``model`` config of a ``Qwen2MoeConfig``; ValueError for what megand does not implement."""
    m = llama_like_config(config)
    if getattr(config, "use_sliding_window", False):
        raise ValueError("use_sliding_window=true: the Qwen2-MoE adapter maps full attention only (its published "
                         "checkpoints have no window)")
    f, shared = config.moe_intermediate_size, config.shared_expert_intermediate_size
    if not shared or shared % f:
        raise ValueError(f"shared_expert_intermediate_size={shared} is not a positive multiple of "
                         f"moe_intermediate_size={f} (megand's shared experts are moe_shared_experts x {f} wide)")
    return dict(m, qkv_bias=bool(config.qkv_bias), num_experts=config.num_experts,
                moe_top_k=config.num_experts_per_tok, moe_ffn_hidden_size=f, moe_shared_experts=shared // f,
                moe_shared_expert_gate=True, moe_router="softmax", moe_norm_topk_prob=bool(config.norm_topk_prob),
                moe_layer_freq=_layer_freq(config),
                moe_aux_loss_coeff=float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0))


def moe_model_rules(m: dict, shared=lambda p, mlp: []) -> list[Rule]:
    """Llama-like layers whose MoE layers hold ``mlp.gate`` and routed experts ``mlp.experts.{e}.gate/up/
    down_proj`` (Qwen2-MoE, Qwen3-MoE); ``shared(p, mlp)``: the rules of what else an MoE layer holds."""
    first, last = embedding_rules(m)
    out = first
    moe_layers = set(moe_layer_ids(m))
    experts = range(m["num_experts"])
    for i in range(m["num_layers"]):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        out += attention_rules(m, p, q)
        if i not in moe_layers:
            out += mlp_rules(p + "mlp.", q + "mlp.")
            continue
        mlp = q + "mlp."
        out += [
            Rule(p + "mlp.router.weight", (mlp + "gate.weight",)),
            experts_fc1_rule(p + "mlp.experts.fc1.weight", [f"{mlp}experts.{e}.gate_proj.weight" for e in experts],
                             [f"{mlp}experts.{e}.up_proj.weight" for e in experts]),
            experts_fc2_rule(p + "mlp.experts.fc2.weight", [f"{mlp}experts.{e}.down_proj.weight" for e in experts]),
            *shared(p, mlp),
        ]
    return out + last


def rules(m: dict) -> list[Rule]:
    return moe_model_rules(m, lambda p, mlp: [
        *mlp_rules(p + "mlp.shared_experts.", mlp + "shared_expert."),
        Rule(p + "mlp.shared_experts.gate.weight", (mlp + "shared_expert_gate.weight",))])


FAMILY = Family("qwen2_moe", "Qwen2MoeForCausalLM",
                expresses={**LLAMA_SHAPE, "num_query_groups": None, "qkv_bias": None, **QWEN_MOE,
                           "moe_shared_experts": None, "moe_shared_expert_gate": None},
                marks=LLAMA_MARKS | {"num_experts", "moe_shared_experts", "moe_shared_expert_gate"},
                reads=LLAMA_LIKE_READS | QWEN_WINDOW_READS | QWEN_MOE_READS | {"shared_expert_intermediate_size",
                                                                               "qkv_bias"},
                ignores=DROPOUT | {"output_router_logits"},  # a forward option (returns the router's logits)
                hf_config=hf_config, model_config=model_config, rules=rules)
