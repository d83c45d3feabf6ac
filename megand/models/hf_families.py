"""The registered Hugging Face families, and the choice of one for export (by the architecture keys a model
sets) and for import (by ``config.json``'s ``model_type``).

A new family is one adapter module with its :class:`~megand.models.hf.Family` record, added to
:data:`FAMILIES` here. No family knows another: export takes the one family that expresses every
architecture key the model sets apart from the schema's defaults (core's ``TransformerConfig``), so a key no
family expresses is refused by name rather than dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from megand.core.transformer.config import architecture
from megand.models import (hf_deepseek_v3, hf_deepseek_v32, hf_gemma3_text, hf_gemma4_text, hf_glm4_moe, hf_gpt2,
                           hf_gpt_oss, hf_llama, hf_mistral, hf_mixtral, hf_olmo3, hf_qwen2, hf_qwen2_moe, hf_qwen3,
                           hf_qwen3_moe, hf_qwen3_5_text, hf_qwen3_next, hf_smollm3)
from megand.models.hf import BOOKKEEPING, CONVERTER_READS, Family

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    hf_llama.FAMILY, hf_qwen2.FAMILY, hf_qwen3.FAMILY, hf_mistral.FAMILY, hf_gpt2.FAMILY, hf_mixtral.FAMILY,
    hf_qwen2_moe.FAMILY, hf_qwen3_moe.FAMILY, hf_deepseek_v3.FAMILY, hf_qwen3_next.FAMILY, hf_qwen3_5_text.FAMILY,
    hf_glm4_moe.FAMILY, hf_gemma3_text.FAMILY, hf_olmo3.FAMILY, hf_smollm3.FAMILY, hf_gemma4_text.FAMILY,
    hf_gpt_oss.FAMILY, hf_deepseek_v32.FAMILY)}


@dataclass(frozen=True)
class LeftOut:
    """A module a family without it may leave out of an export (the main model computes the same without it):
    its architecture key, the prefix of its tensors, and what export says it left."""

    key: str
    prefix: str
    what: str


LEFT_OUT = (LeftOut("mtp_layers", "mtp.", "multi-token prediction depth(s)"),)


def family_names() -> str:
    return ", ".join(FAMILIES)


def family_for_model(m: Mapping[str, Any]) -> Family:
    """The one family that expresses the megand ``model`` config ``m``; ValueError naming what no family
    expresses."""
    keys = architecture(m)
    optional = {o.key for o in LEFT_OUT}
    misses = {name: f.unexpressed(keys, m, optional) for name, f in FAMILIES.items()}
    fits = [name for name, miss in misses.items() if not miss]
    if len(fits) == 1:
        return FAMILIES[fits[0]]
    if fits:  # the registry's families overlap (tests/unit/test_hf_registry.py keeps them apart)
        raise ValueError(f"several Hugging Face families express this model: {', '.join(fits)}")
    orphans = [f"model.{k}={v}" for k, v in keys.items()
               if k not in optional and not any(k in f.expresses for f in FAMILIES.values())]
    if orphans:
        raise ValueError(f"no Hugging Face family expresses {', '.join(orphans)} (families: {family_names()})")
    fewest = min(len(miss) for miss in misses.values())
    nearest = ", ".join(f"{name} ({', '.join(miss)})" for name, miss in misses.items() if len(miss) == fewest)
    raise ValueError(f"no Hugging Face family expresses this model's architecture keys together; nearest: "
                     f"{nearest}; families: {family_names()}")


def family_for_model_type(model_type: str) -> Family:
    """The family that reads a ``config.json`` of ``model_type`` (its own, or one of its ``aliases``)."""
    for family in FAMILIES.values():
        if model_type == family.model_type or model_type in family.aliases:
            return family
    aliases = [a for f in FAMILIES.values() for a in sorted(f.aliases)]
    raise ValueError(f"model_type={model_type!r}: only {', '.join([*FAMILIES, *aliases])} can be imported")


def family_for_hf(config) -> Family:
    """The family of a ``transformers`` config (by its ``model_type``)."""
    return family_for_model_type(config.model_type)


def unread_keys(family: Family, config_keys, attribute_map: Mapping[str, str] | None = None) -> list[str]:
    """The keys of a ``config.json`` (aliases resolved through the config class's ``attribute_map``) that
    ``family`` neither reads nor knowingly ignores."""
    known = family.reads | family.ignores | BOOKKEEPING | CONVERTER_READS
    aliases = attribute_map or {}
    return sorted(k for k in config_keys if aliases.get(k, k) not in known)
