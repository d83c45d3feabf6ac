"""Which keys a query sees: causal, optionally within a sliding window (Mistral), and the local attention
that applies it with SDPA. Shared by the layer, the context-parallel variants, document masks and the KV
cache, so that every attention path agrees on the window's edge."""

import torch
import torch.nn.functional as F

from megand.core.attention_sinks import sink_attention
from megand.core.sdpa import causal_attention


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """``[sq, sk]`` boolean for global positions ``[sq]``, ``[sk]``: the key is not after the query and, with a
    sliding ``window``, fewer than ``window`` tokens before it (the query sees the ``window`` latest keys,
    itself included; as Hugging Face's ``sliding_window``)."""
    distance = q_pos[:, None] - k_pos[None, :]
    return (distance >= 0) if window is None else (distance >= 0) & (distance < window)


def local_attention(q, k, v, window=None, dropout_p=0.0, scale=None, q_offset=0, sinks=None):
    """Causal attention of ``q [b, h, sq, d]`` over ``k, v [b, g, sk, d]`` (the last query is the last key's
    token; ``q_offset``: the first query's position minus the first key's when the queries are a suffix),
    within ``window`` when set. Full-causal windows (no shorter than the keys) take the causal kernel.
    ``sinks [h]``: each head's sink logit in the softmax denominator (:mod:`megand.core.attention_sinks`; no
    dropout)."""
    sq, sk = q.shape[2], k.shape[2]
    gqa = k.shape[1] != q.shape[1]
    if sinks is not None:
        allowed = None
        if window is not None and window < sk:
            allowed = visible(torch.arange(sk - sq, sk, device=q.device), torch.arange(sk, device=q.device), window)[None]
        return sink_attention(q, k, v, sinks, scale, allowed)
    if window is None or window >= sk:
        if sq == sk:  # the fused kernel chosen for the device, precision and heads
            return causal_attention(q, k, v, dropout_p, scale)
        window = None
    q_pos = torch.arange(sk - sq, sk, device=q.device)
    mask = visible(q_pos, torch.arange(sk, device=q.device), window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
