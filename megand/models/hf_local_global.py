"""What the local/global families share (Gemma 3, OLMo 3): ``layer_types`` marks each layer
``sliding_attention`` (a window of ``sliding_window`` latest keys) or ``full_attention``, and ``rope_parameters``
holds one RoPE per layer type. megand's ``model.sliding_window`` is per layer; the full-attention layers' RoPE
is ``model.rope_theta`` / ``model.rope_scaling``, the sliding layers' ``model.rope_local_theta`` (unscaled) when
it differs."""

from __future__ import annotations

import types

from megand.models.hf import When
from megand.models.hf_llama import one_window_size, rope_keys, rope_parameters

LAYER_TYPES = ("full_attention", "sliding_attention")


def windows(config) -> list | None:
    """megand's per-layer ``model.sliding_window`` of a config with ``layer_types`` (kept even when no shorter
    than the context: the layer's RoPE follows its type); None without sliding layers."""
    unknown = sorted(set(config.layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types holds {unknown[0]!r}: megand's layers have full or sliding-window attention")
    if "sliding_attention" not in config.layer_types:
        return None
    if not config.sliding_window:
        raise ValueError(f"layer_types has sliding_attention layers but sliding_window={config.sliding_window}")
    return [config.sliding_window if t == "sliding_attention" else None for t in config.layer_types]


def rope(config) -> dict:
    """megand's ``rope_theta``, ``rope_scaling`` and ``rope_local_theta`` of a config whose ``rope_parameters``
    holds one RoPE per layer type; ValueError naming a scaled sliding layers' RoPE."""
    params = dict(config.rope_parameters or {})
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
    out = rope_keys(types.SimpleNamespace(rope_parameters=full, max_position_embeddings=config.max_position_embeddings))
    out["rope_local_theta"] = None
    if "sliding_attention" in config.layer_types:
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters.sliding_attention.rope_type={local.get('rope_type')!r}: megand's "
                             f"sliding layers have an unscaled RoPE (default)")
        theta = float(local.get("rope_theta", out["rope_theta"]))
        if theta != out["rope_theta"] or out["rope_scaling"] is not None:
            out["rope_local_theta"] = theta
    return out


def rope_per_type(m) -> dict:
    """The ``rope_parameters`` by layer type of a megand ``model`` config."""
    local = m.get("rope_local_theta")
    local = float(m.get("rope_theta", 10000.0) if local is None else local)
    return {"full_attention": rope_parameters(m), "sliding_attention": {"rope_type": "default", "rope_theta": local}}


def layer_types(m) -> dict:
    """``sliding_window`` and ``layer_types`` of a megand ``model`` config (:func:`one_window_size` holds)."""
    w, L = m.get("sliding_window"), m["num_layers"]
    per_layer = list(w) if isinstance(w, (list, tuple)) else [w] * L
    sizes = {x for x in per_layer if x is not None}
    return dict(sliding_window=sizes.pop() if sizes else None,
                layer_types=["sliding_attention" if x is not None else "full_attention" for x in per_layer])


ONE_WINDOW_SIZE = When("one window size for the sliding layers", one_window_size)
LOCAL_THETA = When("model.sliding_window on some layer (the local layers)",
                   lambda m: any(w is not None for w in (m.get("sliding_window") if isinstance(
                       m.get("sliding_window"), (list, tuple)) else [m.get("sliding_window")])))
# the config.json keys windows / rope read
READS = frozenset({"sliding_window", "layer_types", "rope_parameters", "max_position_embeddings"})
