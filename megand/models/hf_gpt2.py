"""State-dict adapter: megand GPT-2-style models <-> ``transformers`` ``GPT2LMHeadModel``.

GPT-2's ``c_attn`` is ``[Q | K | V]`` (megand's fused QKV with one query group per head, regrouped), and
its Conv1D layers store ``[in, out]``: every GPT-2 linear weight is the transpose of megand's. Both use
tanh-GELU (``gelu_new``); LayerNorm's epsilon is ``model.norm_eps``.
"""

from __future__ import annotations

import torch

from megand.core.transformer.attention import fuse_qkv, split_qkv
from megand.models.hf import SIZE, Family, Rule, dims, norm_eps


def hf_config(m: dict):
    from transformers import GPT2Config

    h, heads, _, _ = dims(m)
    return GPT2Config(vocab_size=m["vocab_size"], n_positions=m["seq_length"], n_embd=h, n_layer=m["num_layers"],
                      n_head=heads, n_inner=m["ffn_hidden_size"], activation_function="gelu_new",
                      resid_pdrop=m.get("hidden_dropout", 0.0), embd_pdrop=m.get("hidden_dropout", 0.0),
                      attn_pdrop=m.get("attention_dropout", 0.0), layer_norm_epsilon=norm_eps(m),
                      initializer_range=m.get("init_std", 0.02), tie_word_embeddings=bool(m["tie_embeddings"]),
                      bos_token_id=None, eos_token_id=None)


def model_config(config) -> dict:
    """The megand ``model`` config of a ``GPT2Config``; ValueError for what megand does not implement."""
    h, heads = config.n_embd, config.n_head
    if config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"activation_function={config.activation_function!r}: megand's GPT uses tanh-GELU")
    if config.scale_attn_by_inverse_layer_idx or config.reorder_and_upcast_attn:
        raise ValueError("scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
    if not getattr(config, "scale_attn_weights", True):
        raise ValueError("scale_attn_weights=false: megand scales the attention scores by 1/sqrt(head width)")
    if getattr(config, "add_cross_attention", False):
        raise ValueError("add_cross_attention=true: megand's GPT is a decoder without cross-attention")
    return dict(arch="gpt", num_layers=config.n_layer, hidden_size=h, ffn_hidden_size=config.n_inner or 4 * h,
                num_attention_heads=heads, num_query_groups=None, seq_length=config.n_positions,
                vocab_size=config.vocab_size, norm="layernorm", norm_eps=float(config.layer_norm_epsilon),
                activation="gelu", position_embedding="learned",
                rope_theta=10000.0, tie_embeddings=bool(config.tie_word_embeddings),
                init_std=config.initializer_range, hidden_dropout=0.0, attention_dropout=0.0)


def _transposed(t: torch.Tensor) -> tuple[torch.Tensor]:
    return (t.t(),)


def _untransposed(t: torch.Tensor) -> torch.Tensor:
    return t.t()


def rules(m: dict) -> list[Rule]:
    _, heads, _, _ = dims(m)

    def qkv_to_hf(t):  # weight [3h, h] -> Conv1D [h, 3h]; bias [3h] -> [3h]
        merged = torch.cat(split_qkv(t, heads, heads))
        return (merged.t() if merged.dim() == 2 else merged,)

    def qkv_from_hf(t):
        rows = t.t() if t.dim() == 2 else t
        return fuse_qkv(*rows.chunk(3), heads)

    out = [Rule("embedding.word.weight", ("transformer.wte.weight",)),
           Rule("embedding.position", ("transformer.wpe.weight",))]
    for i in range(m["num_layers"]):
        p, q = f"layers.{i}.", f"transformer.h.{i}."
        out += [
            Rule(p + "attention.qkv.weight", (q + "attn.c_attn.weight",), qkv_to_hf, qkv_from_hf),
            Rule(p + "attention.qkv.bias", (q + "attn.c_attn.bias",), qkv_to_hf, qkv_from_hf),
            Rule(p + "attention.proj.weight", (q + "attn.c_proj.weight",), _transposed, _untransposed),
            Rule(p + "attention.proj.bias", (q + "attn.c_proj.bias",)),
            Rule(p + "mlp.fc1.weight", (q + "mlp.c_fc.weight",), _transposed, _untransposed),
            Rule(p + "mlp.fc1.bias", (q + "mlp.c_fc.bias",)),
            Rule(p + "mlp.fc2.weight", (q + "mlp.c_proj.weight",), _transposed, _untransposed),
            Rule(p + "mlp.fc2.bias", (q + "mlp.c_proj.bias",)),
        ]
        for ours, theirs in (("input_norm", "ln_1"), ("post_attention_norm", "ln_2")):
            out += [Rule(p + ours + ".weight", (q + theirs + ".weight",)),
                    Rule(p + ours + ".bias", (q + theirs + ".bias",))]
    out += [Rule("final_norm.weight", ("transformer.ln_f.weight",)), Rule("final_norm.bias", ("transformer.ln_f.bias",))]
    if not m["tie_embeddings"]:
        out.append(Rule("output_layer.weight", ("lm_head.weight",)))
    return out


# megand's defaults (arch gpt, LayerNorm, GELU, learned positions) are GPT-2's: multi-head, the derived head width
FAMILY = Family("gpt2", "GPT2LMHeadModel", expresses=SIZE, marks=frozenset(),
                reads=frozenset({"n_embd", "n_head", "n_layer", "n_inner", "n_positions", "vocab_size",
                                 "layer_norm_epsilon", "activation_function", "scale_attn_by_inverse_layer_idx",
                                 "reorder_and_upcast_attn", "scale_attn_weights", "add_cross_attention",
                                 "tie_word_embeddings", "initializer_range"}),
                # dropout; n_ctx: older files' copy of n_positions; summary_*: GPT2DoubleHeadsModel's classifier
                ignores=frozenset({"attn_pdrop", "embd_pdrop", "resid_pdrop", "n_ctx", "summary_activation",
                                   "summary_first_dropout", "summary_proj_to_labels", "summary_type",
                                   "summary_use_proj", "task_specific_params"}),
                hf_config=hf_config, model_config=model_config, rules=rules)
