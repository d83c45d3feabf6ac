"""Rotary position embedding (the rotate-half convention of Hugging Face's Llama)."""

import torch


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """cos and sin ``[s, 1, 1, head_dim]`` for global token positions ``[s]``, or ``[s, b, 1, head_dim]`` for
    per-sample positions ``[b, s]`` (positions restarting at each document)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    angles = angles[:, None, None, :] if positions.dim() == 1 else angles.transpose(0, 1)[:, :, None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[s, b, heads, head_dim]``."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
