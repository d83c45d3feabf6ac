"""Hugging Face ``transformers`` interoperability: what every architecture's state-dict adapter shares.

An adapter (:mod:`megand.models.hf_deepseek_v3`, :mod:`megand.models.hf_llama`, :mod:`megand.models.hf_qwen2`, :mod:`megand.models.hf_qwen3`,
:mod:`megand.models.hf_mistral` (import only), :mod:`megand.models.hf_gpt2`, :mod:`megand.models.hf_mixtral`,
:mod:`megand.models.hf_qwen2_moe`, :mod:`megand.models.hf_qwen3_moe`) is the one place that knows how
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

NORM_EPS = 1e-5  # megand's default norm epsilon (model.norm_eps)


def norm_eps(m: Mapping[str, Any]) -> float:
    return float(m.get("norm_eps") or NORM_EPS)


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
    """(hidden, heads, query groups, head dim) of a megand ``model`` config, as the model schema (core's
    TransformerConfig) derives them."""
    from megand.core.transformer import TransformerConfig

    shape = TransformerConfig.from_model(m)
    return shape.hidden_size, shape.num_attention_heads, shape.query_groups, shape.head_dim


def head_dim_derived(m: Mapping[str, Any]) -> bool:
    """Whether the head width is the schema's derived one (architectures without a ``head_dim`` of their own)."""
    from megand.core.transformer.config import resolve_head_dim

    return m.get("head_dim") in (None, resolve_head_dim(m["hidden_size"], m["num_attention_heads"]))


def experts_fc1_rule(name: str, gate: list[str], up: list[str]) -> Rule:
    """Routed experts' fc1 ``[E, 2f, h]`` (each expert's rows fused as ``fuse_swiglu`` does) <-> one gate
    and one up ``[f, h]`` tensor per expert (HF order: expert 0's gate, up, expert 1's gate, up, ...)."""
    from megand.core.transformer.mlp import fuse_swiglu, split_swiglu

    def to_hf(t):
        return tuple(piece for expert in t for piece in split_swiglu(expert))

    def from_hf(*pieces):
        return torch.stack([fuse_swiglu(g, u) for g, u in zip(pieces[0::2], pieces[1::2])])

    return Rule(name, tuple(n for pair in zip(gate, up) for n in pair), to_hf, from_hf)


def experts_fc2_rule(name: str, down: list[str]) -> Rule:
    """Routed experts' fc2 ``[E, h, f]`` <-> one down ``[h, f]`` tensor per expert."""
    return Rule(name, tuple(down), lambda t: tuple(t.unbind(0)), lambda *pieces: torch.stack(pieces))


def moe_layer_ids(m: Mapping[str, Any]) -> list[int]:
    """The MoE layers of a megand ``model`` config: layer i when i % moe_layer_freq == 0 and i >=
    moe_first_k_dense_replace."""
    if not m.get("num_experts"):
        return []
    freq, first = m.get("moe_layer_freq") or 1, m.get("moe_first_k_dense_replace") or 0
    return [i for i in range(m["num_layers"]) if i % freq == 0 and i >= first]


def _adapters():
    from megand.models import (hf_deepseek_v3, hf_gpt2, hf_llama, hf_mistral, hf_mixtral, hf_qwen2, hf_qwen2_moe,
                               hf_qwen3, hf_qwen3_moe)

    return (hf_llama, hf_qwen2, hf_qwen3, hf_mistral, hf_gpt2, hf_mixtral, hf_qwen2_moe, hf_qwen3_moe, hf_deepseek_v3)


def adapter_for(m: Mapping[str, Any]):
    """The adapter module for a megand ``model`` config, or ValueError naming what does not fit."""
    for adapter in _adapters():
        if adapter.matches(m):
            return adapter
    if m.get("num_experts"):
        raise ValueError(
            f"no Hugging Face architecture for this MoE model: arch={m['arch']} num_experts={m['num_experts']} "
            f"moe_router={m.get('moe_router', 'softmax')} moe_shared_experts={m.get('moe_shared_experts', 0)} "
            f"moe_shared_expert_gate={m.get('moe_shared_expert_gate', False)} "
            f"moe_layer_freq={m.get('moe_layer_freq', 1)} moe_norm_topk_prob={m.get('moe_norm_topk_prob', True)} "
            f"qkv_bias={m.get('qkv_bias', False)} head_dim={m.get('head_dim')} (mixtral: llama-style, softmax router, renormalised top-k, "
            "no shared experts, every layer MoE, no q/k/v biases; qwen2_moe: llama-style, softmax router, "
            "shared experts with their gate, head_dim null; qwen3_moe: qk_norm, softmax router, no shared experts; "
            "deepseek_v3: latent attention (kv_lora_rank), sigmoid router, ungated shared experts)")
    raise ValueError(f"no Hugging Face architecture for this model: arch={m['arch']} norm={m['norm']} "
                     f"activation={m['activation']} position_embedding={m['position_embedding']} "
                     f"qkv_bias={m.get('qkv_bias', False)} qk_norm={m.get('qk_norm', False)} head_dim={m.get('head_dim')} "
                     f"(llama: rmsnorm+swiglu+rope, no q/k/v biases; qwen2: llama with q/k/v biases, head_dim null; "
                     f"qwen3: llama with qk_norm; gpt: layernorm+gelu+learned, multi-head, head_dim null)")


def adapter_for_hf(config):
    """The adapter module for a ``transformers`` config."""
    for adapter in _adapters():
        if adapter.MODEL_TYPE == config.model_type:
            return adapter
    # the adapters' MODEL_TYPEs, spelled out (the troubleshooting page quotes this line)
    raise ValueError(f"model_type={config.model_type!r}"
                     ": only llama, qwen2, qwen3, mistral, gpt2, mixtral, qwen2_moe, qwen3_moe, deepseek_v3 can be imported")


def _require_transformers():
    try:
        import transformers
    except ImportError as e:  # a dev dependency (pip install megand[dev])
        raise RuntimeError("this needs the package `transformers` (pip install 'megand[dev]')") from e
    return transformers


def hf_config(model: Mapping[str, Any], attn_implementation: str = "sdpa", experts_implementation: str | None = None):
    """The ``transformers`` config of the same shape (``LlamaConfig``, ``GPT2Config``, ``MixtralConfig`` or
    ``Qwen2MoeConfig``: the mapping that checkpoint export uses too)."""
    _require_transformers()
    cfg = adapter_for(model).hf_config(dict(model))
    cfg._attn_implementation = attn_implementation
    if experts_implementation is not None:  # MoE models: "eager" loops over experts with visible matmuls
        cfg._experts_implementation = experts_implementation
    return cfg


def build_hf_model(model: Mapping[str, Any], attn_implementation: str = "sdpa",
                   experts_implementation: str | None = None):
    """A freshly initialised ``transformers`` model of the same shape on the CPU (benchmark baseline)."""
    tf = _require_transformers()
    cfg = hf_config(model, attn_implementation, experts_implementation)
    return getattr(tf, adapter_for(model).MODEL_CLASS)(cfg)
