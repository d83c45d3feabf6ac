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
    positions (a slice of the sequence under context parallelism)."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids
        self._block_masks = {}

    def attend(self, q, k, v, q_pos=None, k_pos=None, scale=None, window=None):
        """``q [b, h, sq, d]``, ``k, v [b, g, sk, d]`` at global positions ``q_pos [sq]``, ``k_pos [sk]``
        (default: the whole sequence); ``window``: sliding-window attention. Rows with no visible key (none
        when q_pos covers k_pos) give 0."""
        if q_pos is None:
            q_pos = torch.arange(q.shape[2], device=q.device)
        if k_pos is None:
            k_pos = torch.arange(k.shape[2], device=k.device)
        gqa = k.shape[1] != q.shape[1]
        if q.device.type == "cuda":
            return self._flex(q, k, v, q_pos, k_pos, gqa, scale, window)
        q_doc, k_doc = self.ids[:, q_pos], self.ids[:, k_pos]
        mask = dense_document_mask(q_doc, k_doc, q_pos, k_pos, window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)

    def _flex(self, q, k, v, q_pos, k_pos, gqa, scale, window=None):
        from torch.nn.attention.flex_attention import create_block_mask

        key = (q_pos.data_ptr(), q_pos.numel(), k_pos.data_ptr(), k_pos.numel(), window)
        block_mask = self._block_masks.get(key)
        if block_mask is None:
            ids, qp, kp = self.ids, q_pos, k_pos
            reach = window if window is not None else ids.shape[1] + 1  # beyond any distance: no window

            def mask_mod(b, h, qi, ki):
                return (ids[b, qp[qi]] == ids[b, kp[ki]]) & (qp[qi] >= kp[ki]) & (qp[qi] - kp[ki] < reach)

            block_mask = create_block_mask(mask_mod, B=ids.shape[0], H=None, Q_LEN=q_pos.numel(),
                                           KV_LEN=k_pos.numel(), device=q.device, _compile=True)
            self._block_masks[key] = block_mask
        return _compiled_flex_attention()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
