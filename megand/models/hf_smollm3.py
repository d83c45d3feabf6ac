"""State-dict adapter: megand SmolLM3 models <-> ``transformers`` ``SmolLM3ForCausalLM``.

SmolLM3 is the LLaMA layout with no RoPE on some layers (NoPE): ``no_rope_layers`` holds per layer 1 where the
layer applies RoPE, 0 where not (every fourth layer in the published model; megand's ``model.no_rope``: true
where not), and optionally a sliding window on layers ``layer_types`` marks. A SmolLM3 with RoPE on every layer
and no window is a Llama and exports as one.
"""

from __future__ import annotations

import types

from megand.models.hf import Family, When, dims, norm_eps
from megand.models.hf_llama import (DROPOUT, LLAMA_LIKE_READS, LLAMA_MARKS, LLAMA_SHAPE, ONE_WINDOW_SIZE,
                                    llama_like_config, qwen_window_keys, rope_parameters)
from megand.models.hf_llama import rules as llama_rules

SOME_NOPE = When("model.no_rope true on some layer", lambda m: any(m.get("no_rope") or ()))


def hf_config(m: dict):
    from transformers import SmolLM3Config

    h, heads, groups, _ = dims(m)
    no_rope = m.get("no_rope") or [False] * m["num_layers"]
    window = qwen_window_keys(m)
    window.pop("max_window_layers", None)
    return SmolLM3Config(vocab_size=m["vocab_size"], hidden_size=h, intermediate_size=m["ffn_hidden_size"],
                         num_hidden_layers=m["num_layers"], num_attention_heads=heads, num_key_value_heads=groups,
                         hidden_act="silu", max_position_embeddings=m["seq_length"],
                         initializer_range=m.get("init_std", 0.02), rms_norm_eps=norm_eps(m),
                         rope_parameters=rope_parameters(m), tie_word_embeddings=bool(m["tie_embeddings"]),
                         attention_bias=False, mlp_bias=False, attention_dropout=m.get("attention_dropout", 0.0),
                         no_rope_layers=[0 if n else 1 for n in no_rope], **window,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)


def model_config(config) -> dict:
    """The megand ``model`` config of a ``SmolLM3Config``; ValueError naming what megand does not implement."""
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ValueError("attention_bias / mlp_bias=true: megand's SmolLM3 has no linear biases")
    plain = types.SimpleNamespace(**{**config.to_dict(), "head_dim": None})
    no_rope = [not bool(v) for v in config.no_rope_layers]
    if len(no_rope) != config.num_hidden_layers:
        raise ValueError(f"no_rope_layers has {len(no_rope)} entries for num_hidden_layers={config.num_hidden_layers}")
    return dict(llama_like_config(plain), no_rope=no_rope if any(no_rope) else None)


def rules(m: dict):
    return llama_rules(m)


FAMILY = Family("smollm3", "SmolLM3ForCausalLM",
                expresses={**LLAMA_SHAPE, "num_query_groups": None, "no_rope": SOME_NOPE,
                           "sliding_window": ONE_WINDOW_SIZE},
                marks=LLAMA_MARKS | {"no_rope"},
                reads=(LLAMA_LIKE_READS - {"head_dim"}) | {"attention_bias", "mlp_bias", "no_rope_layers",
                                                           "use_sliding_window", "sliding_window", "layer_types"},
                ignores=DROPOUT | {"no_rope_layer_interval"},  # the default no_rope_layers' rule, once they are written
                hf_config=hf_config, model_config=model_config, rules=rules)
