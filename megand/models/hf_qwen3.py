"""State-dict adapter: megand Qwen3-style dense models <-> ``transformers`` ``Qwen3ForCausalLM``: the LLaMA
layout with an RMSNorm over each query and key head before RoPE (``model.qk_norm``) and a head width of its
own (``model.head_dim``)."""

from __future__ import annotations

from megand.models.hf import Family, dims, norm_eps
from megand.models.hf_llama import (ATTENTION, DROPOUT, LLAMA_LIKE_READS, LLAMA_MARKS, LLAMA_SHAPE, ONE_WINDOW_SIZE,
                                    QWEN_WINDOW_READS, llama_like_config, qwen_window_keys, rope_parameters)
from megand.models.hf_llama import rules as llama_rules


def hf_config(m: dict):
    from transformers import Qwen3Config

    h, heads, groups, hd = dims(m)
    return Qwen3Config(vocab_size=m["vocab_size"], hidden_size=h, intermediate_size=m["ffn_hidden_size"],
                       num_hidden_layers=m["num_layers"], num_attention_heads=heads, num_key_value_heads=groups,
                       head_dim=hd, hidden_act="silu", max_position_embeddings=m["seq_length"],
                       initializer_range=m.get("init_std", 0.02), rms_norm_eps=norm_eps(m),
                       rope_parameters=rope_parameters(m), tie_word_embeddings=bool(m["tie_embeddings"]),
                       attention_bias=False, **qwen_window_keys(m),
                       attention_dropout=m.get("attention_dropout", 0.0),
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


def model_config(config) -> dict:
    """The megand ``model`` config of a ``Qwen3Config``; ValueError for what megand does not implement."""
    if getattr(config, "attention_bias", False):
        raise ValueError("attention_bias=true: Qwen3 then has a bias on o_proj too; megand's qkv_bias covers "
                         "q/k/v only")
    return dict(llama_like_config(config), qk_norm=True)


def rules(m: dict):
    return llama_rules(m)


FAMILY = Family("qwen3", "Qwen3ForCausalLM",
                expresses={**LLAMA_SHAPE, **ATTENTION, "qk_norm": None, "sliding_window": ONE_WINDOW_SIZE},
                marks=LLAMA_MARKS | {"qk_norm"}, reads=LLAMA_LIKE_READS | QWEN_WINDOW_READS | {"attention_bias"},
                ignores=DROPOUT, hf_config=hf_config, model_config=model_config, rules=rules)
