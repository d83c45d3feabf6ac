"""State-dict adapter: megand Qwen2/Qwen2.5-style dense models <-> ``transformers`` ``Qwen2ForCausalLM``:
the LLaMA layout with biases on the query, key and value projections (``model.qkv_bias``)."""

from __future__ import annotations

from megand.models.hf import Family, dims, norm_eps
from megand.models.hf_llama import (DROPOUT, LLAMA_LIKE_READS, LLAMA_MARKS, LLAMA_SHAPE, ONE_WINDOW_SIZE,
                                    QWEN_WINDOW_READS, llama_like_config, qwen_window_keys, rope_parameters)
from megand.models.hf_llama import rules as llama_rules


def hf_config(m: dict):
    from transformers import Qwen2Config

    h, heads, groups, _ = dims(m)
    return Qwen2Config(vocab_size=m["vocab_size"], hidden_size=h, intermediate_size=m["ffn_hidden_size"],
                       num_hidden_layers=m["num_layers"], num_attention_heads=heads, num_key_value_heads=groups,
                       hidden_act="silu", max_position_embeddings=m["seq_length"],
                       initializer_range=m.get("init_std", 0.02), rms_norm_eps=norm_eps(m),
                       rope_parameters=rope_parameters(m), tie_word_embeddings=bool(m["tie_embeddings"]),
                       **qwen_window_keys(m), attention_dropout=m.get("attention_dropout", 0.0),
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


def model_config(config) -> dict:
    """The megand ``model`` config of a ``Qwen2Config``; ValueError for what megand does not implement."""
    return dict(llama_like_config(config), qkv_bias=True)


def rules(m: dict):
    return llama_rules(m)


# no head_dim of its own: Qwen2Config derives it from hidden/heads
FAMILY = Family("qwen2", "Qwen2ForCausalLM",
                expresses={**LLAMA_SHAPE, "num_query_groups": None, "qkv_bias": None,
                           "sliding_window": ONE_WINDOW_SIZE},
                marks=LLAMA_MARKS | {"qkv_bias"}, reads=LLAMA_LIKE_READS | QWEN_WINDOW_READS, ignores=DROPOUT,
                hf_config=hf_config, model_config=model_config, rules=rules)
