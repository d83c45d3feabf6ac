"""State-dict adapter: megand LLaMA-style models with sliding-window attention <-> ``transformers``
``MistralForCausalLM``.

Mistral's tensors and maths are LLaMA's (with ``head_dim`` possibly apart from hidden/heads, as in Mistral
NeMo) plus one sliding window for every layer (``model.sliding_window``; a query sees that many latest keys,
itself included). A checkpoint without a window (Mistral 7B v0.2 and later, NeMo: ``sliding_window`` null)
or with one no shorter than its context imports with full attention; megand then has no key that marks the
family, so its export writes the equivalent ``LlamaForCausalLM``.
"""

from __future__ import annotations

from megand.models.hf import Family, When, dims, norm_eps
from megand.models.hf_llama import (ATTENTION, DROPOUT, LLAMA_LIKE_READS, LLAMA_MARKS, LLAMA_SHAPE, llama_like_config,
                                    rope_parameters)
from megand.models.hf_llama import rules as llama_rules

ONE_WINDOW = When("one window for every layer (an int)",
                  lambda m: isinstance(m.get("sliding_window"), int) and not isinstance(m.get("sliding_window"), bool))


def hf_config(m: dict):
    from transformers import MistralConfig

    h, heads, groups, hd = dims(m)
    return MistralConfig(vocab_size=m["vocab_size"], hidden_size=h, intermediate_size=m["ffn_hidden_size"],
                         num_hidden_layers=m["num_layers"], num_attention_heads=heads, num_key_value_heads=groups,
                         head_dim=hd, hidden_act="silu", max_position_embeddings=m["seq_length"],
                         initializer_range=m.get("init_std", 0.02), rms_norm_eps=norm_eps(m),
                         rope_parameters=rope_parameters(m), tie_word_embeddings=bool(m["tie_embeddings"]),
                         sliding_window=m["sliding_window"], attention_dropout=m.get("attention_dropout", 0.0),
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)


def model_config(config) -> dict:
    """The megand ``model`` config of a ``MistralConfig``; ValueError for what megand does not implement."""
    window = getattr(config, "sliding_window", None)
    if window is not None and window >= config.max_position_embeddings:
        window = None  # no shorter than the context: full attention
    return dict(llama_like_config(config), sliding_window=window)


def rules(m: dict):
    return llama_rules(m)


FAMILY = Family("mistral", "MistralForCausalLM", expresses={**LLAMA_SHAPE, **ATTENTION, "sliding_window": ONE_WINDOW},
                marks=LLAMA_MARKS | {"sliding_window"}, reads=LLAMA_LIKE_READS | {"sliding_window"}, ignores=DROPOUT,
                hf_config=hf_config, model_config=model_config, rules=rules)
