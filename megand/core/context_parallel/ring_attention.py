"""Context-parallel causal attention: ring (p2p) and all-gather variants.

Every cp rank holds its tokens in the load-balanced layout of ``sequence.py`` (chunks r and 2cp-1-r of
2cp): q ``[b, nh, s_local, d]``, k/v ``[b, ng, s_local, d]`` with nh % ng == 0. Only the ng K/V heads
are communicated; locally the query heads of one group are folded into the row dimension
(``[b, ng, nh/ng * s, d]``), so K/V are never copied nh/ng times.

Block attention (``block_kernels.py``) runs on a fused flash kernel in the model's dtype on CUDA (bf16/fp16)
and as explicit fp32 math otherwise, where one block's score matrix (at most s_local x s_local) is the
only quadratic temporary. Either way backward recomputes each block from the saved q, k, v, the final
output and log-sum-exp (as flash attention does), so what is saved for backward is O(s_local).

Documents (``document_ids [b, s]`` of the whole sequence): a query sees a key of its own document that
is not later. A block with no such pair is skipped (neither computed nor communicated for backward work);
a partial block is masked; rows of a block that see nothing contribute nothing (lse -inf). The
all-gather variant also cuts each query chunk's keys to start at the earliest document it touches.
"""

import torch
import torch.distributed as dist

from megand.core.attention_masks import visible as visible_keys
from megand.core.attention_sinks import finish, sinks_grad
from megand.core.context_parallel.block_kernels import blocks_for
from megand.core.context_parallel.sequence import cp_positions, merge_cp_shards, split_for_cp

# ---------------------------------------------------------------- block attention (no communication)


def _merge(out, lse, block_out, block_lse):
    """In place: combine a partial (out, lse) with another block's by the log-sum-exp rule."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)


def _check(q, k, v):
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or q.shape[1] % k.shape[1]:
        raise ValueError(f"expected q [b, nh, s, d], k and v [b, ng, s, d] with nh % ng == 0; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[2] % 2:
        raise ValueError(f"the local sequence ({q.shape[2]}) must be two equal chunks (load-balanced layout)")


def _allowed(ids, qp, kp, window=None):
    """``[b, sq, sk]`` (``[1, sq, sk]`` without documents): key not after the query, within the sliding
    ``window``, and in the query's document (``ids``, when given)."""
    allowed = visible_keys(qp, kp, window)[None]
    return allowed if ids is None else allowed & (ids[:, qp][:, :, None] == ids[:, kp][:, None, :])


def _document_pieces(pieces, ids, q_pos, k_pos, visible=None, window=None):
    """``(q slice, kv slice, causal, allowed)`` of the pieces that do any work. Without documents
    (``ids`` None) and window the pieces as they are; with either the mask of each piece (:func:`_allowed`),
    the pieces ``visible`` (host bools, one per piece) marks as fully masked left out: a block wholly
    outside the window is neither computed nor, in backward, worked on."""
    for i, (qs, ks, causal) in enumerate(pieces):
        if ids is None and window is None:
            yield qs, ks, causal, None
        elif visible[i]:
            yield qs, ks, False, _allowed(ids, q_pos[qs], k_pos[ks], window)


def _memo(documents, key, compute):
    """``compute()`` once per micro-batch: kept on the documents object (one per micro-batch, shared by
    every layer) when it offers a ``memo`` dict."""
    memo = getattr(documents, "memo", None)
    if memo is None:
        return compute()
    if key not in memo:
        memo[key] = compute()
    return memo[key]


# ---------------------------------------------------------------- ring attention


def _ring_send_recv(send_buf, group):
    """Post the async send of ``send_buf`` to the next rank of the ring and the receive of the previous
    rank's into a new buffer; return (receive buffer, requests to wait on)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    recv_buf = torch.empty_like(send_buf)
    ops = [dist.P2POp(dist.isend, send_buf, dist.get_global_rank(group, (rank + 1) % size), group),
           dist.P2POp(dist.irecv, recv_buf, dist.get_global_rank(group, (rank - 1) % size), group)]
    return recv_buf, dist.batch_isend_irecv(ops)


def _ring_pieces(step, src, cp_rank, half):
    """The work on the K/V block of rank ``src``: [(q slice, kv slice, causal)], in the load-balanced layout.

    Rank r holds chunks r and 2cp-1-r. Own block (step 0): my early half sees my early half causally,
    my late half sees both of my halves, causally at its end. src < r: src's early chunk precedes both
    of mine and its late chunk follows both, so all my queries see its first half. src > r: both of its
    chunks lie between my two, so only my late half sees them, all of them.
    """
    first, second, whole = slice(0, half), slice(half, None), slice(None)
    if step == 0:
        return [(first, first, True), (second, whole, True)]
    if src < cp_rank:
        return [(whole, first, False)]
    return [(second, whole, False)]


def _plan_ids(documents):
    """``(ids, device)`` to plan from: the host copy of the document ids where the documents carry one
    (no device read), else the device ids; no documents: positions alone, on the host."""
    if documents is None:
        return None, torch.device("cpu")
    host = getattr(documents, "host_ids", None)
    ids = documents.ids if host is None else host
    return ids, ids.device


def _ring_visibility(ids, device, cp_rank, cp_size, half, window=None):
    """``[step][piece]`` host bools: whether each piece of the ring sees any key of its queries'
    documents. All blocks' flags in one read (a read per block would wait for the device each time)."""
    seq = 2 * half * cp_size
    q_pos = cp_positions(seq, cp_rank, cp_size, device)
    flags, shape = [], []
    for step in range(cp_size):
        src = (cp_rank - step) % cp_size
        k_pos = cp_positions(seq, src, cp_size, device)
        pieces = _ring_pieces(step, src, cp_rank, half)
        flags += [_allowed(ids, q_pos[qs], k_pos[ks], window).any() for qs, ks, _ in pieces]
        shape.append(len(pieces))
    host = torch.stack(flags).tolist()  # the one read of the micro-batch's document layout (none: host ids)
    out, at = [], 0
    for n in shape:
        out.append(host[at: at + n])
        at += n
    return out


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp_group, scale, ids, visible, window, sinks=None):
        cp_rank, cp_size = dist.get_rank(cp_group), dist.get_world_size(cp_group)
        half = q.shape[2] // 2
        q_pos = cp_positions(2 * half * cp_size, cp_rank, cp_size, q.device)
        blocks = blocks_for(q)
        qb = blocks.prepare(q)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])  # the block that travels, in the input dtype
        for step in range(cp_size):
            if step + 1 < cp_size:  # start moving the next block before computing on this one
                next_kv, kv_reqs = _ring_send_recv(kv, cp_group)
            block_k, block_v = blocks.prepare(kv).unbind(0)
            src = (cp_rank - step) % cp_size
            k_pos = cp_positions(2 * half * cp_size, src, cp_size, q.device)
            for qs, ks, causal, allowed in _document_pieces(_ring_pieces(step, src, cp_rank, half), ids, q_pos, k_pos,
                                                            visible and visible[step], window):
                _merge(out[:, :, qs], lse[:, :, qs],
                       *blocks.forward(qb[:, :, qs], block_k[:, :, ks], block_v[:, :, ks], scale, causal, allowed))
            if step + 1 < cp_size:
                for req in kv_reqs:
                    req.wait()
                kv = next_kv
        if sinks is not None:  # backward then works from the finished output and log-sum-exp
            out, lse = finish(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.cp_group, ctx.scale, ctx.ids, ctx.visible, ctx.window = cp_group, scale, ids, visible, window
        return out.to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        cp_group, scale, ids, visible, window = ctx.cp_group, ctx.scale, ctx.ids, ctx.visible, ctx.window
        cp_rank, cp_size = dist.get_rank(cp_group), dist.get_world_size(cp_group)
        half = q.shape[2] // 2
        q_pos = cp_positions(2 * half * cp_size, cp_rank, cp_size, q.device)
        blocks = blocks_for(q)
        qb, doutb = blocks.prepare(q), blocks.prepare(dout)
        delta = (dout.float() * out).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        # Second ring: K/V travel as in forward; the gradient of each block (fp32) travels one step behind
        # it, each rank adding its contribution, and after cp hops arrives back at the block's owner.
        for step in range(cp_size):
            if step + 1 < cp_size:
                next_kv, kv_reqs = _ring_send_recv(kv, cp_group)
            block_k, block_v = blocks.prepare(kv).unbind(0)
            block_dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            src = (cp_rank - step) % cp_size
            k_pos = cp_positions(2 * half * cp_size, src, cp_size, q.device)
            for qs, ks, causal, allowed in _document_pieces(_ring_pieces(step, src, cp_rank, half), ids, q_pos, k_pos,
                                                            visible and visible[step], window):
                block_dq, block_dk, block_dv = blocks.backward(
                    doutb[:, :, qs], qb[:, :, qs], block_k[:, :, ks], block_v[:, :, ks], out[:, :, qs], lse[:, :, qs],
                    delta[:, :, qs], scale, causal, allowed)
                dq[:, :, qs] += block_dq
                block_dkv[0, :, :, ks] += block_dk
                block_dkv[1, :, :, ks] += block_dv
            if step > 0:  # add what the ranks before us contributed to this block
                for req in dkv_reqs:
                    req.wait()
                block_dkv += dkv
            if step + 1 < cp_size:
                for req in kv_reqs:
                    req.wait()
                kv = next_kv
            if cp_size > 1:
                dkv_in_flight = block_dkv  # keep the send buffer referenced until its request completes
                dkv, dkv_reqs = _ring_send_recv(dkv_in_flight, cp_group)
        if cp_size > 1:
            for req in dkv_reqs:
                req.wait()
        else:
            dkv = block_dkv
        dsinks = None if sinks is None else sinks_grad(delta, lse, sinks)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, dsinks


def ring_attention(q, k, v, cp_group, softmax_scale=None, documents=None, window=None, sinks=None):
    """Causal attention over the whole sequence of ``cp_group``, local tokens in the load-balanced layout.

    q ``[b, nh, s_local, d]``, k/v ``[b, ng, s_local, d]`` (GQA when ng < nh); returns ``[b, nh, s_local, d]``.
    K/V blocks rotate around the ring (p2p), overlapped with the computation on the current block.
    ``documents`` (anything with ``ids [b, s]``, the whole sequence's document ids): attention within documents.
    ``window``: sliding-window attention (a query sees its ``window`` latest keys). ``sinks [nh]``: each head's
    sink logit in the softmax denominator, applied once the blocks are merged (:mod:`megand.core.attention_sinks`).
    """
    _check(q, k, v)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    if documents is None and window is None:
        return _RingAttention.apply(q, k, v, cp_group, scale, None, None, None, sinks)
    cp_rank, cp_size, half = dist.get_rank(cp_group), dist.get_world_size(cp_group), q.shape[2] // 2
    visible = _memo(documents, ("ring", cp_rank, cp_size, half, window),
                    lambda: _ring_visibility(*_plan_ids(documents), cp_rank, cp_size, half, window))
    ids = None if documents is None else documents.ids
    return _RingAttention.apply(q, k, v, cp_group, scale, ids, visible, window, sinks)


# ---------------------------------------------------------------- all-gather attention

# torch 2.13 renamed the single-tensor collectives (the old names still work, with a FutureWarning)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather_kv(kv, cp_group):
    """[2, b, ng, s_local, d] on every rank -> [2, b, ng, s, d] in global token order."""
    cp_size = dist.get_world_size(cp_group)
    gathered = torch.empty((cp_size * kv.shape[0], *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
    _all_gather_single(gathered, kv.contiguous(), group=cp_group)  # ranks concatenated along dim 0
    return merge_cp_shards(list(gathered.view(cp_size, *kv.shape).unbind(0)), dim=3)


def _all_gather_pieces(cp_rank, cp_size, half):
    """[(q slice, global kv slice, causal)]: local chunk j sees the keys of chunks 0..j, causally at the end."""
    return [(slice(0, half), slice(0, (cp_rank + 1) * half), True),
            (slice(half, None), slice(0, (2 * cp_size - cp_rank) * half), True)]


def _all_gather_plan(ids, device, cp_rank, cp_size, half, window=None):
    """With documents or a window: ``(pieces, visible)``, with documents each piece's keys starting at the
    first token of the earliest document of its query chunk, and whether it sees any key; one host read."""
    q_pos = cp_positions(2 * half * cp_size, cp_rank, cp_size, device)
    k_pos = torch.arange(2 * half * cp_size, device=device)
    pieces = _all_gather_pieces(cp_rank, cp_size, half)
    values = []
    # the first global position of each local chunk (chunks cp_rank and 2cp-1-cp_rank of 2cp)
    for first in (cp_rank * half, (2 * cp_size - 1 - cp_rank) * half) if ids is not None else ():
        values.append(torch.searchsorted(ids, ids[:, first: first + 1]).min())  # document ids never decrease
    for qs, ks, _ in pieces:  # keys of earlier documents are invisible: the trim changes no flag
        values.append(_allowed(ids, q_pos[qs], k_pos[ks], window).any().long())
    host = torch.stack(values).tolist()  # the one read of the micro-batch's document layout (none: host ids)
    if ids is None:
        return pieces, host
    n = len(pieces)
    trimmed = [(qs, slice(start, ks.stop), causal) for (qs, ks, causal), start in zip(pieces, host[:n])]
    return trimmed, host[n:]


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp_group, scale, ids, plan, window, sinks=None):
        cp_rank, cp_size = dist.get_rank(cp_group), dist.get_world_size(cp_group)
        blocks = blocks_for(q)
        k_all, v_all = blocks.prepare(_all_gather_kv(torch.stack([k, v]), cp_group)).unbind(0)
        qb = blocks.prepare(q)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        for qs, ks, causal, allowed in _all_gather_work(q, cp_rank, cp_size, ids, plan, window):
            out[:, :, qs], lse[:, :, qs] = blocks.forward(qb[:, :, qs], k_all[:, :, ks], v_all[:, :, ks], scale,
                                                          causal, allowed)
        if sinks is not None:
            out, lse = finish(out, lse, sinks)
        # the gathered K/V are not saved (that would be O(s) per rank): backward gathers them again
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.cp_group, ctx.scale, ctx.ids, ctx.plan, ctx.window = cp_group, scale, ids, plan, window
        return out.to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        cp_group, scale, ids, plan, window = ctx.cp_group, ctx.scale, ctx.ids, ctx.plan, ctx.window
        cp_rank, cp_size = dist.get_rank(cp_group), dist.get_world_size(cp_group)
        blocks = blocks_for(q)
        k_all, v_all = blocks.prepare(_all_gather_kv(torch.stack([k, v]), cp_group)).unbind(0)
        qb, doutb = blocks.prepare(q), blocks.prepare(dout)
        delta = (dout.float() * out).sum(-1)
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dkv_all = torch.zeros((2, *k_all.shape), dtype=torch.float32, device=k.device)  # from this rank's queries
        for qs, ks, causal, allowed in _all_gather_work(q, cp_rank, cp_size, ids, plan, window):
            dq[:, :, qs], dk, dv = blocks.backward(doutb[:, :, qs], qb[:, :, qs], k_all[:, :, ks], v_all[:, :, ks],
                                                   out[:, :, qs], lse[:, :, qs], delta[:, :, qs], scale, causal,
                                                   allowed)
            dkv_all[0, :, :, ks] += dk
            dkv_all[1, :, :, ks] += dv
        # sum the contributions of all ranks and hand each rank the gradient of its own tokens
        dkv_by_rank = torch.cat([split_for_cp(dkv_all, 3, r, cp_size) for r in range(cp_size)])  # ranks along dim 0
        local_dkv = torch.empty_like(dkv_by_rank[:2])
        _reduce_scatter_single(local_dkv, dkv_by_rank, group=cp_group)
        dsinks = None if sinks is None else sinks_grad(delta, lse, sinks)
        return dq.to(q.dtype), local_dkv[0].to(k.dtype), local_dkv[1].to(v.dtype), None, None, None, None, None, dsinks


def _all_gather_work(q, cp_rank, cp_size, ids, plan, window):
    half = q.shape[2] // 2
    if plan is None:  # no documents, no window
        return _document_pieces(_all_gather_pieces(cp_rank, cp_size, half), None, None, None)
    q_pos = cp_positions(2 * half * cp_size, cp_rank, cp_size, q.device)
    k_pos = torch.arange(2 * half * cp_size, device=q.device)
    pieces, visible = plan
    return _document_pieces(pieces, ids, q_pos, k_pos, visible, window)


def all_gather_attention(q, k, v, cp_group, softmax_scale=None, documents=None, window=None, sinks=None):
    """Same contract as ``ring_attention``; K/V all-gathered, dK/dV reduce-scattered (no overlap)."""
    _check(q, k, v)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    if documents is None and window is None:
        return _AllGatherAttention.apply(q, k, v, cp_group, scale, None, None, None, sinks)
    cp_rank, cp_size, half = dist.get_rank(cp_group), dist.get_world_size(cp_group), q.shape[2] // 2
    plan = _memo(documents, ("all_gather", cp_rank, cp_size, half, window),
                 lambda: _all_gather_plan(*_plan_ids(documents), cp_rank, cp_size, half, window))
    ids = None if documents is None else documents.ids
    return _AllGatherAttention.apply(q, k, v, cp_group, scale, ids, plan, window, sinks)
