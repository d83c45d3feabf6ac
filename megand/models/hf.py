"""Hugging Face ``transformers`` interoperability: what every family's state-dict adapter shares.

An adapter (one ``hf_<family>.py`` module, registered in :mod:`megand.models.hf_families`) is the one place
that knows how megand's full tensors map to one ``transformers`` architecture: its :class:`Family` record
(the ``model_type`` it reads and writes, the architecture keys it expresses, the ``config.json`` keys it
reads or knowingly ignores), its config (both ways) and one :class:`Rule` per megand tensor. The fused
layouts are not re-encoded here: the rules call the functions of the layers that define them
(``fuse_qkv``/``split_qkv``, ``fuse_swiglu``/``split_swiglu``). Rules work one tensor at a time and on meta
tensors, so conversion streams and shapes are checked before any data is read.
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
    # ``(dim, index, count)``: the one HF tensor packs ``count`` megand tensors side by side along ``dim`` and this
    # rule's is block ``index`` (Gemma 4's per-layer embeddings: every layer's table in one): export joins the
    # blocks of the rules naming that tensor, import cuts each rule its own. None: the HF tensors are this rule's
    block: tuple[int, int, int] | None = None

    def hf_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """The HF tensors' shapes for a megand tensor of ``shape`` (computed on meta tensors; a packed tensor's
        whole shape)."""
        shapes = {n: tuple(t.shape) for n, t in zip(self.hf, self.to_hf(torch.empty(shape, device="meta")))}
        if self.block is None:
            return shapes
        dim, _, count = self.block
        return {n: s[:dim] + (s[dim] * count,) + s[dim + 1:] for n, s in shapes.items()}

    def cut(self, packed: torch.Tensor) -> torch.Tensor:
        """This rule's block of the packed HF tensor (a copy: the packed tensor is not kept alive by it)."""
        dim, index, count = self.block
        return packed.chunk(count, dim)[index].contiguous()



@dataclass(frozen=True)
class When:
    """The values of a key that a family expresses, as a condition on the whole megand ``model`` config."""

    text: str  # e.g. "model.moe_router=sigmoid": what the refusal names
    holds: Callable[[Mapping[str, Any]], bool]


def equals(key: str, value: Any) -> When:
    return When(f"model.{key}={value}", lambda m: m.get(key) == value)


# the architecture keys every family expresses: the model's size
SIZE: dict[str, When | None] = dict.fromkeys(("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                              "vocab_size", "tie_embeddings", "norm_eps"))
# config.json keys of every transformers config that shape no weight nor what the model computes: bookkeeping,
# generation defaults of older files, the token ids (megand's tokenizer owns them) and the storage dtype
BOOKKEEPING = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "id2label",
    "label2id", "problem_type", "output_attentions", "output_hidden_states", "return_dict", "torchscript",
    "chunk_size_feed_forward", "is_encoder_decoder", "tokenizer_class", "finetuning_task", "max_length",
    "min_length", "do_sample", "temperature", "top_k", "top_p", "num_beams", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "num_return_sequences", "early_stopping"})
# config.json keys the converter reads for every family (block-scaled fp8 weights are dequantized on import)
CONVERTER_READS = frozenset({"quantization_config"})


@dataclass(frozen=True)
class Family:
    """One Hugging Face architecture megand reads and writes: the record every reader consults.

    Export takes the one family whose ``expresses`` covers every architecture key the model sets apart from
    the schema's defaults and whose ``marks`` are all set; import takes the family of ``config.json``'s
    ``model_type`` and refuses a key of the file outside ``reads``, ``ignores`` and :data:`BOOKKEEPING`."""

    model_type: str
    model_class: str  # the transformers class export writes (config.json's ``architectures``)
    expresses: Mapping[str, When | None]  # architecture key -> the values it expresses (None: any)
    marks: frozenset[str]  # keys that tell this family from the others: each must be set
    reads: frozenset[str]  # config.json keys model_config reads (and refuses where megand cannot follow)
    ignores: frozenset[str]  # config.json keys it knowingly leaves: dropout, training-only, derived values
    hf_config: Callable  # megand ``model`` -> transformers config
    model_config: Callable  # transformers config -> megand ``model``
    rules: Callable[..., list[Rule]]  # megand ``model`` -> one Rule per megand tensor
    mtp_marker: Callable | None = None  # megand ``model`` -> a tensor files with multi-token prediction hold
    # other ``model_type`` values whose config.json is this family's config under another name (Kimi-K2 publishes
    # DeepSeek-V3's architecture as ``kimi_k2``, for its own code): import reads them as this family's config
    aliases: frozenset[str] = frozenset()
    # megand ``model`` -> the tensors of the files that hold no megand weight but a fixed value (Gemma 4's
    # ``layer_scalar`` buffers): export writes them, import refuses a file whose values differ, by name
    constants: Callable[..., dict[str, torch.Tensor]] | None = None

    def unexpressed(self, keys: Mapping[str, Any], m: Mapping[str, Any], optional=frozenset()) -> list[str]:
        """What keeps this family from expressing a model whose set architecture keys are ``keys`` (``m``: the
        whole config; ``optional``: keys a family may leave out): one phrase per key, empty when it fits."""
        out = [f"needs model.{k}" for k in sorted(self.marks) if k not in keys]
        for k, v in keys.items():
            if k not in self.expresses:
                if k not in optional:
                    out.append(f"no model.{k}={v}")
            elif self.expresses[k] is not None and not self.expresses[k].holds(m):
                out.append(f"model.{k}={v} only with {self.expresses[k].text}")
        return out


def dims(m: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """(hidden, heads, query groups, head dim) of a megand ``model`` config, as the model schema (core's
    TransformerConfig) derives them."""
    from megand.core.transformer import TransformerConfig

    shape = TransformerConfig.from_model(m)
    return shape.hidden_size, shape.num_attention_heads, shape.query_groups, shape.head_dim


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


def is_moe_layer(m: Mapping[str, Any], i: int) -> bool:
    """Whether layer ``i`` of a megand ``model`` config is MoE (i % moe_layer_freq == 0 and i >=
    moe_first_k_dense_replace); multi-token prediction depth k's layer has index num_layers + k - 1."""
    freq, first = m.get("moe_layer_freq") or 1, m.get("moe_first_k_dense_replace") or 0
    return bool(m.get("num_experts")) and i % freq == 0 and i >= first


def moe_layer_ids(m: Mapping[str, Any]) -> list[int]:
    """The MoE layers of the main model of a megand ``model`` config."""
    return [i for i in range(m["num_layers"]) if is_moe_layer(m, i)]


def _require_transformers():
    try:
        import transformers
    except ImportError as e:  # a dev dependency (pip install megand[dev])
        raise RuntimeError("this needs the package `transformers` (pip install 'megand[dev]')") from e
    return transformers


def hf_config(model: Mapping[str, Any], attn_implementation: str = "sdpa", experts_implementation: str | None = None):
    """The ``transformers`` config of the same shape (``LlamaConfig``, ``GPT2Config``, ``MixtralConfig`` or
    ``Qwen2MoeConfig``: the mapping that checkpoint export uses too)."""
    from megand.models.hf_families import family_for_model

    _require_transformers()
    cfg = family_for_model(model).hf_config(dict(model))
    cfg._attn_implementation = attn_implementation
    if experts_implementation is not None:  # MoE models: "eager" loops over experts with visible matmuls
        cfg._experts_implementation = experts_implementation
    return cfg


def build_hf_model(model: Mapping[str, Any], attn_implementation: str = "sdpa",
                   experts_implementation: str | None = None):
    """A freshly initialised ``transformers`` model of the same shape on the CPU (benchmark baseline); eager
    attention where the class has no SDPA attention."""
    from megand.models.hf_families import family_for_model

    tf = _require_transformers()
    cls = getattr(tf, family_for_model(model).model_class)
    if attn_implementation == "sdpa" and not cls._supports_sdpa:  # its attention has no SDPA form (GPT-OSS's sinks)
        attn_implementation = "eager"
    return cls(hf_config(model, attn_implementation, experts_implementation))
