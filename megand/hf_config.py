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
    """A ``LlamaConfig`` (arch=llama) or ``GPT2Config`` (arch=gpt) of the same shape (the mapping that
    checkpoint export uses too)."""
    _require_transformers()
    from megand.core.checkpointing.hf import hf_model_config

    cfg = hf_model_config({k: v for k, v in dict(model).items()})
    cfg._attn_implementation = attn_implementation
    return cfg


def build_hf_model(model: Mapping[str, Any], attn_implementation: str = "sdpa"):
    """A freshly initialised ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` on the CPU."""
    tf = _require_transformers()
    cfg = hf_config(model, attn_implementation)
    cls = tf.LlamaForCausalLM if Shape.from_config(model).arch == "llama" else tf.GPT2LMHeadModel
    return cls(cfg)
