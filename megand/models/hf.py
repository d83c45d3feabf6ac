"""Hugging Face ``transformers`` interoperability: what every architecture's state-dict adapter shares.

An adapter (:mod:`megand.models.hf_llama`, :mod:`megand.models.hf_gpt2`) is the one place that knows how
megand's full tensors map to one ``transformers`` architecture: its config (both ways) and one
:class:`Rule` per megand tensor. The fused layouts are not re-encoded here: the rules call the functions
of the layers that define them (``fuse_qkv``/``split_qkv``, ``fuse_swiglu``/``split_swiglu``). Rules work
one tensor at a time and on meta tensors, so conversion streams and shapes are checked before any data
is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

NORM_EPS = 1e-5


def _one(t: torch.Tensor) -> tuple[torch.Tensor]:
    return (t,)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class Rule:
    """One megand full tensor and the Hugging Face tensors it is made of."""

    megand: str
    hf: tuple[str, ...]
    to_hf: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] = _one  # megand tensor -> HF tensors (order of hf)
    from_hf: Callable[..., torch.Tensor] = _same  # HF tensors (order of hf) -> megand tensor

    def hf_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """The HF tensors' shapes for a megand tensor of ``shape`` (computed on meta tensors)."""
        return {n: tuple(t.shape) for n, t in zip(self.hf, self.to_hf(torch.empty(shape, device="meta")))}


def dims(m: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """(hidden, heads, query groups, head dim) of a megand ``model`` config."""
    h, heads = m["hidden_size"], m["num_attention_heads"]
    return h, heads, m.get("num_query_groups") or heads, h // heads


def _adapters():
    from megand.models import hf_gpt2, hf_llama

    return (hf_llama, hf_gpt2)


def adapter_for(m: Mapping[str, Any]):
    """The adapter module for a megand ``model`` config, or ValueError naming what does not fit."""
    for adapter in _adapters():
        if adapter.matches(m):
            return adapter
    raise ValueError(f"no Hugging Face architecture for this model: arch={m['arch']} norm={m['norm']} "
                     f"activation={m['activation']} position_embedding={m['position_embedding']} "
                     f"(llama: rmsnorm+swiglu+rope; gpt: layernorm+gelu+learned, multi-head)")


def adapter_for_hf(config):
    """The adapter module for a ``transformers`` config."""
    for adapter in _adapters():
        if adapter.MODEL_TYPE == config.model_type:
            return adapter
    raise ValueError(f"model_type={config.model_type!r}: only llama and gpt2 can be imported")


def _require_transformers():
    try:
        import transformers
    except ImportError as e:  # a dev dependency (pip install megand[dev])
        raise RuntimeError("this needs the package `transformers` (pip install 'megand[dev]')") from e
    return transformers


def hf_config(model: Mapping[str, Any], attn_implementation: str = "sdpa"):
    """A ``LlamaConfig`` (arch=llama) or ``GPT2Config`` (arch=gpt) of the same shape (the mapping that
    checkpoint export uses too)."""
    _require_transformers()
    cfg = adapter_for(model).hf_config(dict(model))
    cfg._attn_implementation = attn_implementation
    return cfg


def build_hf_model(model: Mapping[str, Any], attn_implementation: str = "sdpa"):
    """A freshly initialised ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` on the CPU (benchmark baseline)."""
    tf = _require_transformers()
    cfg = hf_config(model, attn_implementation)
    return getattr(tf, adapter_for(model).MODEL_CLASS)(cfg)
