"""Rotary position embedding (the rotate-half convention of Hugging Face's Llama), with the frequency
scalings that stretch a model's context: ``linear`` (position interpolation), ``llama3`` (Llama 3.1+: low
frequencies divided by the factor, high ones kept, a smooth ramp between) and ``yarn`` (NTK-by-parts
interpolation and an attention temperature folded into cos and sin), and ``proportional`` (Gemma 4's global
layers: only the first ``partial_rotary_factor`` of the frequencies turn, each at the angle it has in the whole
head; the others are zero, so their dimension pairs, ``i`` and ``i + head_dim / 2``, stay as they are)."""

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch

ROPE_TYPES = ("linear", "llama3", "yarn", "proportional")


@dataclass(frozen=True)
class RopeScaling:
    """``model.rope_scaling``: a dict with the keys (and meanings) of Hugging Face's ``rope_scaling``."""

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None  # llama3 and yarn: the context the model was trained at
    low_freq_factor: float = 1.0   # llama3: wavelengths above original/low_freq_factor are divided by factor
    high_freq_factor: float = 4.0  # llama3: wavelengths below original/high_freq_factor are kept
    beta_fast: float = 32.0        # yarn: the rotation counts bounding the interpolation ramp
    beta_slow: float = 1.0
    mscale: float | None = None          # yarn: the attention temperature is mscale(factor, mscale) /
    mscale_all_dim: float | None = None  # mscale(factor, mscale_all_dim) when both are set
    attention_factor: float | None = None  # yarn: the temperature itself (null: from the factor)
    truncate: bool = True          # yarn: round the ramp's bounds to whole dimensions
    partial_rotary_factor: float = 1.0  # proportional: the share of the frequencies that turn

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "RopeScaling":
        """ValueError naming an unknown key, a missing one or a value out of range."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"model.rope_scaling: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(names))})")
        kind = values.get("rope_type")
        if kind == "proportional":  # transformers' default factor for this type
            values = {"factor": 1.0, **values}
        if kind not in ROPE_TYPES:
            raise ValueError(f"model.rope_scaling.rope_type={kind!r}: expected one of {', '.join(ROPE_TYPES)}")
        if values.get("factor") is None or not values["factor"] > 0:
            raise ValueError(f"model.rope_scaling.factor={values.get('factor')} must be > 0 (rope_type={kind})")
        if kind in ("llama3", "yarn") and not values.get("original_max_position_embeddings"):
            raise ValueError(f"model.rope_scaling.rope_type={kind} needs original_max_position_embeddings")
        scaling = cls(**values)
        if not 0 <= scaling.partial_rotary_factor <= 1 or (scaling.partial_rotary_factor != 1 and kind != "proportional"):
            raise ValueError(f"model.rope_scaling.partial_rotary_factor={scaling.partial_rotary_factor}: expected "
                             f"0..1, with rope_type=proportional (got {kind})")
        if kind == "llama3" and not scaling.high_freq_factor > scaling.low_freq_factor > 0:
            raise ValueError(f"model.rope_scaling: high_freq_factor={scaling.high_freq_factor} must exceed "
                             f"low_freq_factor={scaling.low_freq_factor} > 0 (rope_type=llama3)")
        return scaling


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                        device=None) -> tuple[torch.Tensor, float]:
    """The ``head_dim / 2`` rotation frequencies and the factor cos and sin are multiplied by."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / theta ** exponents
    if scaling is None:
        return inv_freq, 1.0
    factor = scaling.factor
    if scaling.rope_type == "linear":
        return inv_freq / factor, 1.0
    if scaling.rope_type == "proportional":  # as transformers counts the turning frequencies
        turning = int(scaling.partial_rotary_factor * head_dim // 2)
        return torch.cat([inv_freq[:turning], torch.zeros_like(inv_freq[turning:])]) / factor, 1.0
    original = scaling.original_max_position_embeddings
    if scaling.rope_type == "llama3":
        low_wavelen, high_wavelen = original / scaling.low_freq_factor, original / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn: frequencies interpolated (divided by the factor) below a ramp over the dimensions, kept above it
    attention = scaling.attention_factor
    if attention is None:
        attention = (yarn_mscale(factor, scaling.mscale) / yarn_mscale(factor, scaling.mscale_all_dim)
                     if scaling.mscale and scaling.mscale_all_dim else yarn_mscale(factor))

    def correction_dim(rotations):
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp  # share of the original frequency kept
    return inv_freq / factor * (1 - extrapolated) + inv_freq * extrapolated, float(attention)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling | None = None):
    """cos and sin ``[s, 1, 1, head_dim]`` for global token positions ``[s]``, or ``[s, b, 1, head_dim]`` for
    per-sample positions ``[b, s]`` (positions restarting at each document)."""
    inv_freq, attention_factor = inverse_frequencies(head_dim, theta, scaling, positions.device)
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    angles = angles[:, None, None, :] if positions.dim() == 1 else angles.transpose(0, 1)[:, :, None, :]
    if attention_factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[s, b, heads, head_dim]``; partial rotary (cos/sin narrower than the head): its first dims."""
    if cos.shape[-1] < x.shape[-1]:
        d = cos.shape[-1]
        return torch.cat([apply_rope(x[..., :d], cos, sin), x[..., d:]], dim=-1)
    # x * cos + [-second, first] * sin, written half by half: the same operations on the same values (bitwise
    # equal), without the rotated copy of x, which a compiled layer wrote in two passes of its own
    first, second = x.float().chunk(2, dim=-1)
    (cos_1, cos_2), (sin_1, sin_2) = cos.chunk(2, dim=-1), sin.chunk(2, dim=-1)
    return torch.cat([first * cos_1 - second * sin_1, second * cos_2 + first * sin_2], dim=-1).to(x.dtype)
