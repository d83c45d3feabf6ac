"""State-dict adapter: megand OLMo 3 models <-> ``transformers`` ``Olmo3ForCausalLM``.

OLMo 3 is the LLaMA layout with its norms on the branch outputs (``post_attention_layernorm`` and
``post_feedforward_layernorm`` before each residual add, none before the branches: megand's
``model.norm_placement=post``, norms ``attention_output_norm`` and ``mlp_output_norm``), RMSNorms over the whole
query and key projections before RoPE (``model.qk_norm_scope=projection``), and sliding-window and full layers by
``layer_types`` (three of the first per one of the second in the published models) with a RoPE each (the full
layers' may be scaled: ``rope_local_theta`` then holds the sliding layers' unscaled base). OLMo 3 derives its head
width (hidden / heads).
"""

from __future__ import annotations

import types

from megand.models import hf_local_global as lg
from megand.models.hf import Family, Rule, dims, equals, norm_eps
from megand.models.hf_llama import (DROPOUT, LLAMA_MARKS, LLAMA_SHAPE, attention_rules, embedding_rules,
                                    llama_like_config, mlp_rules)

READS = frozenset({"hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "hidden_act",
                   "intermediate_size", "vocab_size", "rms_norm_eps", "tie_word_embeddings", "initializer_range",
                   "attention_bias"}) | lg.READS


def hf_config(m: dict):
    from transformers import Olmo3Config

    h, heads, groups, _ = dims(m)
    return Olmo3Config(vocab_size=m["vocab_size"], hidden_size=h, intermediate_size=m["ffn_hidden_size"],
                       num_hidden_layers=m["num_layers"], num_attention_heads=heads, num_key_value_heads=groups,
                       hidden_act="silu", max_position_embeddings=m["seq_length"],
                       initializer_range=m.get("init_std", 0.02), rms_norm_eps=norm_eps(m),
                       rope_parameters=lg.rope_per_type(m), tie_word_embeddings=bool(m["tie_embeddings"]),
                       attention_bias=False, attention_dropout=m.get("attention_dropout", 0.0), **lg.layer_types(m),
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


def model_config(config) -> dict:
    """The megand ``model`` config of an ``Olmo3Config``; ValueError naming what megand does not implement."""
    if getattr(config, "attention_bias", False):
        raise ValueError("attention_bias=true: megand's OLMo attention has no biases")
    plain = types.SimpleNamespace(**{**config.to_dict(), "rope_parameters": None, "use_sliding_window": False,
                                     "head_dim": None})
    return dict(llama_like_config(plain), **lg.rope(config), qk_norm=True, qk_norm_scope="projection",
                norm_placement="post", sliding_window=lg.windows(config))


def rules(m: dict) -> list[Rule]:
    first, last = embedding_rules(m)
    out = first
    for i in range(m["num_layers"]):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        out += [r for r in attention_rules(m, p, q) if not r.megand.endswith(("input_norm.weight",
                                                                              "post_attention_norm.weight"))]
        out += [Rule(p + "attention_output_norm.weight", (q + "post_attention_layernorm.weight",)),
                Rule(p + "mlp_output_norm.weight", (q + "post_feedforward_layernorm.weight",))]
        out += mlp_rules(p + "mlp.", q + "mlp.")
    return out + last


FAMILY = Family("olmo3", "Olmo3ForCausalLM",
                expresses={**LLAMA_SHAPE, "num_query_groups": None, "qk_norm": equals("qk_norm", True),
                           "qk_norm_scope": equals("qk_norm_scope", "projection"),
                           "norm_placement": equals("norm_placement", "post"), "sliding_window": lg.ONE_WINDOW_SIZE,
                           "rope_local_theta": lg.LOCAL_THETA},
                marks=LLAMA_MARKS | {"qk_norm", "qk_norm_scope", "norm_placement"}, reads=READS, ignores=DROPOUT,
                hf_config=hf_config, model_config=model_config, rules=rules)
