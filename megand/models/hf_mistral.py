"""Import adapter: ``transformers`` ``MistralForCausalLM`` -> megand's LLaMA layout.

Mistral's tensors and maths are LLaMA's (with ``head_dim`` possibly apart from hidden/heads, as in Mistral
NeMo); what sets the family apart is sliding-window attention. Checkpoints without a window (Mistral 7B
v0.2 and later, NeMo: ``sliding_window`` null), or with one no shorter than the context, import; a shorter
window is refused in one line. megand's model has no key that marks the family, so an export writes the
equivalent ``LlamaForCausalLM``.
"""

from __future__ import annotations

from megand.models.hf_llama import llama_like_config
from megand.models.hf_llama import rules as llama_rules

MODEL_TYPE = "mistral"
MODEL_CLASS = "MistralForCausalLM"


def matches(m) -> bool:
    return False  # export goes through the Llama adapter (same tensors, same maths)


def model_config(config) -> dict:
    """The megand ``model`` config of a ``MistralConfig``; ValueError for what megand does not implement."""
    window = getattr(config, "sliding_window", None)
    if window is not None and window < config.max_position_embeddings:
        raise ValueError(f"sliding_window={window} < max_position_embeddings={config.max_position_embeddings}: "
                         f"megand has no sliding-window attention yet")
    return llama_like_config(config)


def rules(m: dict):
    return llama_rules(m)
