"""Map megand model config keys to an equivalent Hugging Face ``transformers`` model.

Used by the baseline benchmark and by tests that check our formulas against a reference
implementation. ``transformers`` is an optional dependency: it is imported only when called.
"""

from typing import Any, Mapping

from megand.training.flops import Shape


def _require_transformers():
    try:
        import transformers
    except ImportError as e:  # optional dependency (pip install megand[dev])
        raise RuntimeError("this needs the optional package `transformers` "
                           "(pip install transformers)") from e
    return transformers


def hf_config(model: Mapping[str, Any], attn_implementation: str = "sdpa"):
    """A ``LlamaConfig`` (arch=llama) or ``GPT2Config`` (arch=gpt) of the same shape."""
    tf = _require_transformers()
    s = Shape.from_config(model)
    std = float(model.get("init_std", 0.02) or 0.02)
    hidden_dropout = float(model.get("hidden_dropout", 0.0) or 0.0)
    attention_dropout = float(model.get("attention_dropout", 0.0) or 0.0)
    if s.arch == "llama":
        cfg = tf.LlamaConfig(
            vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.ffn,
            num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.groups,
            max_position_embeddings=s.seq, rope_theta=float(model.get("rope_theta", 10000.0) or 10000.0),
            tie_word_embeddings=s.tied, initializer_range=std, attention_dropout=attention_dropout,
            attention_bias=False, mlp_bias=False, rms_norm_eps=1e-5)
    elif s.arch == "gpt":
        if s.groups != s.heads or s.swiglu or not s.learned_positions:
            raise ValueError("GPT2 reference models support only MHA, GELU and learned positions")
        cfg = tf.GPT2Config(
            vocab_size=s.vocab, n_embd=s.hidden, n_inner=s.ffn, n_layer=s.layers, n_head=s.heads,
            n_positions=s.seq, activation_function="gelu", initializer_range=std,
            resid_pdrop=hidden_dropout, embd_pdrop=hidden_dropout, attn_pdrop=attention_dropout,
            tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    else:
        raise ValueError(f"unknown arch {s.arch!r}")
    cfg._attn_implementation = attn_implementation
    return cfg


def build_hf_model(model: Mapping[str, Any], attn_implementation: str = "sdpa"):
    """A freshly initialised ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` on the CPU."""
    tf = _require_transformers()
    cfg = hf_config(model, attn_implementation)
    cls = tf.LlamaForCausalLM if Shape.from_config(model).arch == "llama" else tf.GPT2LMHeadModel
    return cls(cfg)
