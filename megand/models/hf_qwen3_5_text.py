"""State-dict adapter: megand dense hybrid Gated DeltaNet / attention models <-> ``transformers``
``Qwen3_5ForCausalLM`` (Qwen3.5's language model, ``model_type: qwen3_5_text``).

Qwen3.5's text model computes what a dense Qwen3-Next does (:mod:`megand.models.hf_qwen3_next`: the layer
pattern, the gated attention with partial rotary, the (1 + w) RMSNorms, the Gated DeltaNet layers) and stores
the linear attention's in-projections apart: ``in_proj_qkv`` (all queries, all keys, all values), ``in_proj_z``,
``in_proj_b`` and ``in_proj_a``, where megand fuses them per key head (its queries, key, values and gates,
then its betas and decay inputs) so that a tensor-parallel split gives whole heads.
"""

from __future__ import annotations

import torch

from megand.models.hf import Family, Rule
from megand.models.hf_llama import DROPOUT
from megand.models.hf_qwen3_next import FAMILY as NEXT
from megand.models.hf_qwen3_next import hybrid_config, hybrid_hf_kwargs
from megand.models.hf_qwen3_next import rules as hybrid_rules


def hf_config(m: dict):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**hybrid_hf_kwargs(m))


def model_config(config) -> dict:
    """The megand ``model`` config of a ``Qwen3_5TextConfig``; ValueError for what megand does not implement."""
    return hybrid_config(config)


def linear_rules(m: dict, p: str, q: str) -> list[Rule]:
    """megand's per-key-head in-projections <-> Qwen3.5's ``in_proj_qkv`` (all q, all k, all v), ``in_proj_z``,
    ``in_proj_b`` and ``in_proj_a``."""
    G, dk, dv = m["linear_num_key_heads"], m["linear_key_head_dim"], m["linear_value_head_dim"]
    r = m["linear_num_value_heads"] // G
    a = q + "linear_attn."

    def qkvz_to_hf(t):
        qh, kh, vh, zh = t.reshape(G, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
        flat = [x.reshape(-1, x.shape[-1]) for x in (qh, kh, vh, zh)]
        return torch.cat(flat[:3]), flat[3]

    def qkvz_from_hf(qkv, z):
        h = qkv.shape[-1]
        qh, kh, vh = qkv.split([G * dk, G * dk, G * r * dv])
        parts = [qh.reshape(G, dk, h), kh.reshape(G, dk, h), vh.reshape(G, r * dv, h), z.reshape(G, r * dv, h)]
        return torch.cat(parts, dim=1).reshape(-1, h)

    def ba_to_hf(t):
        bh, ah = t.reshape(G, 2 * r, -1).split([r, r], dim=1)
        return bh.reshape(G * r, -1), ah.reshape(G * r, -1)

    def ba_from_hf(b, a_):
        return torch.cat([b.reshape(G, r, -1), a_.reshape(G, r, -1)], dim=1).reshape(2 * G * r, -1)

    return [Rule(p + "attention.qkvz.weight", (a + "in_proj_qkv.weight", a + "in_proj_z.weight"), qkvz_to_hf,
                 qkvz_from_hf),
            Rule(p + "attention.ba.weight", (a + "in_proj_b.weight", a + "in_proj_a.weight"), ba_to_hf, ba_from_hf)]


def rules(m: dict) -> list[Rule]:
    return hybrid_rules(m, linear_rules)


FAMILY = Family(
    "qwen3_5_text", "Qwen3_5ForCausalLM",
    expresses={k: v for k, v in NEXT.expresses.items() if not k.startswith("moe_") and k != "num_experts"},
    marks=NEXT.marks - {"num_experts"},
    reads=NEXT.reads - {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                        "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
                        "shared_expert_intermediate_size"},
    ignores=DROPOUT, hf_config=hf_config, model_config=model_config, rules=rules)
