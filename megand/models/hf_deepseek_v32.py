"""State-dict adapter: megand models with DeepSeek Sparse Attention on multi-head latent attention <->
``transformers`` ``DeepseekV32ForCausalLM`` (DeepSeek-V3.2, V3.2-Exp).

DeepSeek-V3's architecture (:mod:`megand.models.hf_deepseek_v3`: latent attention with a query latent,
interleaved RoPE rows, the sigmoid-router MoE, multi-token prediction modules) plus each layer's lightning
indexer (``self_attn.indexer``): ``wq_b``/``wk``/``k_norm`` (a LayerNorm with a bias)/``weights_proj`` are
megand's ``attention.indexer.wq``/``wk``/``k_norm``/``weights``. The indexer rotates halves of its first
``qk_rope_head_dim`` dims (not interleaved), as megand does: its rows are copied as they are.
``index_topk``/``index_n_heads``/``index_head_dim`` are ``model.dsa_index_topk``/``dsa_index_heads``/
``dsa_index_head_dim``. transformers' indexer has no training loss (it runs under ``no_grad``); megand's
``model.dsa_indexer_loss_coeff`` is DeepSeek's (:mod:`megand.core.transformer.dsa`).
"""

from __future__ import annotations

from megand.models import hf_deepseek_v3 as v3
from megand.models.hf import Family, Rule
from megand.models.hf_llama import LLAMA_MARKS

EXPRESSES = {**v3.EXPRESSES, **dict.fromkeys(("dsa_index_topk", "dsa_index_heads", "dsa_index_head_dim"))}


def hf_config(m: dict):
    from transformers import DeepseekV32Config

    base = v3.hf_config(m).to_dict()
    keep = {k: base[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                 "qk_rope_head_dim", "v_head_dim", "hidden_act", "max_position_embeddings",
                                 "initializer_range", "rms_norm_eps", "rope_parameters", "tie_word_embeddings",
                                 "attention_bias", "attention_dropout", "num_nextn_predict_layers", "n_routed_experts",
                                 "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "n_group",
                                 "topk_group", "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace")
            if k in base}
    keep["num_key_value_heads"] = m["num_attention_heads"]
    return DeepseekV32Config(**keep, index_topk=m["dsa_index_topk"], index_n_heads=m.get("dsa_index_heads", 64),
                             index_head_dim=m.get("dsa_index_head_dim", 128), bos_token_id=None, eos_token_id=None,
                             pad_token_id=None)


def model_config(config) -> dict:
    """The megand ``model`` config of a ``DeepseekV32Config``; ValueError for what megand does not implement."""
    if config.q_lora_rank is None:
        raise ValueError("q_lora_rank=null: DeepSeek Sparse Attention's indexer reads the query latent")
    if getattr(config, "mlp_bias", False):
        raise ValueError("mlp_bias=true: megand's DeepSeek MLPs have no biases")
    L, first = config.num_hidden_layers, min(config.first_k_dense_replace or 0, config.num_hidden_layers)
    expected = ["dense"] * first + ["sparse"] * (L - first)
    if list(config.mlp_layer_types or expected) != expected:
        raise ValueError(f"mlp_layer_types={config.mlp_layer_types}: megand's MoE layers are the ones after "
                         f"first_k_dense_replace={config.first_k_dense_replace}")
    if any(t != "indexed_attention" for t in (config.layer_types or ())):
        raise ValueError(f"layer_types={config.layer_types}: every DeepSeek-V3.2 layer has indexed attention")
    m = v3.model_config(config)
    return dict(m, dsa_index_topk=config.index_topk, dsa_index_heads=config.index_n_heads,
                dsa_index_head_dim=config.index_head_dim)


def rules(m: dict) -> list[Rule]:
    return v3.mtp_model_rules(m, lambda p, q, moe: _layer_rules(m, p, q, moe))


def _layer_rules(m: dict, p: str, q: str, moe: bool) -> list[Rule]:
    a, qa = p + "attention.indexer.", q + "self_attn.indexer."
    return [*v3._layer_rules(m, p, q, moe, rope_interleave=True),
            Rule(a + "wq", (qa + "wq_b.weight",)), Rule(a + "wk", (qa + "wk.weight",)),
            Rule(a + "k_norm.weight", (qa + "k_norm.weight",)), Rule(a + "k_norm.bias", (qa + "k_norm.bias",)),
            Rule(a + "weights", (qa + "weights_proj.weight",))]


FAMILY = Family("deepseek_v32", "DeepseekV32ForCausalLM", expresses=EXPRESSES,
                marks=LLAMA_MARKS | {"kv_lora_rank", "q_lora_rank", "dsa_index_topk"},
                reads=(v3.FAMILY.reads - {"rope_interleave"}) | {"index_topk", "index_n_heads", "index_head_dim",
                                                                  "mlp_layer_types", "layer_types", "mlp_bias"},
                # as DeepSeek-V3's; head_dim: transformers sets it to qk_rope_head_dim (the RoPE width)
                ignores=v3.FAMILY.ignores,
                hf_config=hf_config, model_config=model_config, rules=rules, mtp_marker=v3.mtp_marker)
