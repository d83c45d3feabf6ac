"""Attention that stops at document boundaries inside a packed sample (Megatron's reset_attention_mask).

A sample packs several documents, each ending with an end-of-document token. ``document_ids`` numbers
them: the EOD token belongs to the document it ends, the token after it starts the next one. A query
attends to a key when both are in the same document and the key is not later (causal).

On CUDA the mask is a FlexAttention block mask (``torch.nn.attention.flex_attention``): blocks entirely
across documents are skipped and nothing of size ``s x s`` is materialised. On CPU a dense boolean mask
with ``scaled_dot_product_attention`` is the simple, tested reference.
"""

import functools

import torch
import torch.nn.functional as F

from megand.core.attention_masks import visible
from megand.core.attention_sinks import sink_attention


def document_ids(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """``[b, s]`` index of the document of each token (0 for the first one); EOD closes its document."""
    ends = (tokens == eod_id).long()
    return torch.cumsum(ends, dim=-1) - ends


def document_positions(ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` position of each token within its document (Megatron's reset_position_ids)."""
    s = ids.shape[-1]
    index = torch.arange(s, device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[..., 1:] = ids[..., 1:] != ids[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index))
    return index - torch.cummax(first, dim=-1).values


def dense_document_mask(q_doc, k_doc, q_pos, k_pos, window=None) -> torch.Tensor:
    """``[b, 1, sq, sk]`` boolean: same document and key visible (causal, within the window). The CPU
    reference."""
    same = q_doc[:, :, None] == k_doc[:, None, :]
    if q_pos.dim() == 1:
        causal = visible(q_pos, k_pos, window)
    else:
        distance = q_pos[:, :, None] - k_pos[:, None, :]
        causal = (distance >= 0) if window is None else (distance >= 0) & (distance < window)
    return (same & causal)[:, None]


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


class DocumentMask:
    """The documents of one micro-batch's full sequence (``ids [b, s]``), shared by every layer.

    ``attend`` computes causal attention restricted to documents for queries and keys at the given global
    positions (a slice of the sequence under context parallelism). On CUDA the FlexAttention block mask
    is built on the first call and reused by every later layer (and by recomputation) of the micro-batch:
    build one ``DocumentMask`` per micro-batch and pass it to every layer."""

    def __init__(self, ids: torch.Tensor, host_ids: torch.Tensor | None = None):
        """``host_ids``: the same ids on the host, where the data pipeline has them: what is planned from
        the documents (context parallelism's block skipping) then reads nothing from the device."""
        self.ids = ids
        self.host_ids = host_ids
        self._whole_masks = {}  # (sq, sk) -> block mask over the whole sequence's positions
        self._position_masks = []  # (q_pos, k_pos, block mask) for explicit positions, matched by identity
        self.memo = {}  # what context-parallel attention derives from the documents once per micro-batch

    def attend(self, q, k, v, q_pos=None, k_pos=None, scale=None, window=None, sinks=None):
        """``q [b, h, sq, d]``, ``k, v [b, g, sk, d]`` at global positions ``q_pos [sq]``, ``k_pos [sk]``
        (default: the whole sequence); ``window``: sliding-window attention. Rows with no visible key (none
        when q_pos covers k_pos) give 0. ``sinks [h]``: each head's sink logit in the softmax denominator, on
        the dense mask (every row must see a key)."""
        gqa = k.shape[1] != q.shape[1]
        if q.device.type == "cuda" and sinks is None:
            return _compiled_flex_attention()(q, k, v, block_mask=self.block_mask(q, k, q_pos, k_pos, window),
                                              scale=scale, enable_gqa=gqa)
        if q_pos is None:
            q_pos = torch.arange(q.shape[2], device=q.device)
        if k_pos is None:
            k_pos = torch.arange(k.shape[2], device=k.device)
        q_doc, k_doc = self.ids[:, q_pos], self.ids[:, k_pos]
        mask = dense_document_mask(q_doc, k_doc, q_pos, k_pos, window)
        if sinks is not None:
            return sink_attention(q, k, v, sinks, scale, mask[:, 0])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)

    def block_mask(self, q, k, q_pos=None, k_pos=None, window=None):
        """The FlexAttention block mask of these positions (and sliding ``window``), built once per
        micro-batch. Keys are what the positions are (the whole sequence by its lengths; explicit position
        tensors by identity, kept alive here), never a tensor's address: a freed tensor's address is reused
        by the next one."""
        if q_pos is None and k_pos is None:
            key = (q.shape[2], k.shape[2], window)
            if key not in self._whole_masks:
                self._whole_masks[key] = self._build(None, None, q.shape[2], k.shape[2], q.device, window)
            return self._whole_masks[key]
        for known_q, known_k, known_window, block_mask in self._position_masks:
            if known_q is q_pos and known_k is k_pos and known_window == window:
                return block_mask
        block_mask = self._build(q_pos, k_pos, q.shape[2], k.shape[2], q.device, window)
        self._position_masks.append((q_pos, k_pos, window, block_mask))
        return block_mask

    def _build(self, q_pos, k_pos, sq, sk, device, window=None):
        from torch.nn.attention.flex_attention import create_block_mask

        ids = self.ids
        reach = window if window is not None else ids.shape[1] + 1  # beyond any distance: no window
        if q_pos is None and k_pos is None:
            def mask_mod(b, h, qi, ki):
                return (ids[b, qi] == ids[b, ki]) & (qi >= ki) & (qi - ki < reach)
        else:
            qp = torch.arange(sq, device=device) if q_pos is None else q_pos
            kp = torch.arange(sk, device=device) if k_pos is None else k_pos

            def mask_mod(b, h, qi, ki):
                return (ids[b, qp[qi]] == ids[b, kp[ki]]) & (qp[qi] >= kp[ki]) & (qp[qi] - kp[ki] < reach)
        return create_block_mask(mask_mod, B=ids.shape[0], H=None, Q_LEN=sq, KV_LEN=sk, device=device, _compile=True)
