"""DeepSeek Sparse Attention's top-k path: each query attends to the ``k`` keys its indexer chose by gathering
them, never building the ``s x s`` mask, so its memory scales with ``s * k``.

Selection (:func:`select_topk`): per block of queries the index scores over every allowed key (``[b, c, s_k]``,
fp32), a stable descending sort (ties towards the earlier key, exactly as the dense reference's selection) and
its first ``k`` key indices; a query with fewer than ``k`` allowed keys marks the rest invalid. Attention
(:func:`sparse_attention`): per block of queries the chosen keys and values are gathered
(``[b, kv heads, c, k, d]``; the query heads of a group share their keys, as in GQA/MQA), the softmax runs in
fp32 over the valid ones, and the block is recomputed in backward (``torch.utils.checkpoint``: only the
inputs and the indices are kept, like a fused kernel keeps only its inputs), so the gathered blocks never
accumulate. Block sizes come from one budget of elements (:data:`BLOCK_ELEMENTS`).

The choice of path lives in :func:`use_sparse`, in one place: the dense mask when every query's top-k covers
at least a quarter of the keys (tiny sequences, the tests' reference: a fused dense kernel over at most 4k keys
is cheaper than gathering), the gather beyond. Both give the same attention (same chosen set); the dense mask
keeps attention dropout and generation (one new query), which the top-k path does not take.
"""

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# the elements one block of queries may materialise (gathered keys and values, its scores): 2^26 (256 MiB in
# fp32) whatever the sequence, so a longer sequence takes more blocks, never larger ones
BLOCK_ELEMENTS = 1 << 26
# the dense mask while the top-k covers more than 1/DENSE_RATIO of the keys
DENSE_RATIO = 4


def wide(x):
    """``x`` in fp32 at least (fp64 stays fp64: the exactness tests run in it)."""
    return x if x.dtype == torch.float64 else x.float()


def use_sparse(keys: int, topk: int) -> bool:
    """The top-k gather (True) or the dense mask (False) for ``keys`` keys per query and top-``topk``."""
    return keys > DENSE_RATIO * topk


def block_size(queries: int, per_query: int) -> int:
    """Queries per block so that ``per_query`` elements for each stay within :data:`BLOCK_ELEMENTS`."""
    return max(1, min(queries, BLOCK_ELEMENTS // max(1, per_query)))


def select_topk(score_fn, allowed_fn, queries: int, keys: int, topk: int, per_query: int):
    """``(index [b, sq, k] int64, valid [b, sq, k] bool)``: each query's ``k = min(topk, keys)`` best allowed keys,
    ordered by score (ties: the earlier key first). ``score_fn(lo, hi)`` gives the index scores ``[b, hi-lo, keys]``
    of queries ``lo:hi``, ``allowed_fn(lo, hi)`` their allowed keys (``[b or 1, hi-lo, keys]``)."""
    k = min(topk, keys)
    step = block_size(queries, per_query)
    index, valid = [], []
    for lo in range(0, queries, step):
        hi = min(queries, lo + step)
        scores = score_fn(lo, hi)
        allowed = allowed_fn(lo, hi).expand_as(scores)
        order = torch.sort(scores.masked_fill(~allowed, float("-inf")), dim=-1, descending=True,
                           stable=True).indices[..., :k]
        index.append(order)
        valid.append(allowed.gather(-1, order))
    return torch.cat(index, 1), torch.cat(valid, 1)


def gather_keys(x, index):
    """``x [b, hk, sk, d]`` at ``index [b, c, k]`` -> ``[b, hk, c, k, d]``."""
    b, hk, _, d = x.shape
    c, k = index.shape[1:]
    flat = index.reshape(b, 1, c * k, 1).expand(b, hk, c * k, d)
    return x.gather(2, flat).view(b, hk, c, k, d)


def _block(q, k, v, index, valid, scale):
    """One block's attention: ``q [b, h, c, d]`` over its gathered keys; ``[b, h, c, dv]``."""
    b, h, c, d = q.shape
    hk = k.shape[1]
    kg, vg = gather_keys(k, index), gather_keys(v, index)
    qg = q.view(b, hk, h // hk, c, d)
    logits = torch.einsum("bjgcd,bjckd->bjgck", wide(qg), wide(kg)) * scale
    probs = torch.softmax(logits.masked_fill(~valid[:, None, None], float("-inf")), dim=-1)
    out = torch.einsum("bjgck,bjckd->bjgcd", probs, wide(vg))
    return out.to(q.dtype).reshape(b, h, c, v.shape[-1])


def sparse_attention(q, k, v, index, valid, scale=None, step=None):
    """Attention of queries ``q [b, h, sq, d]`` over keys and values ``k, v [b, hk, sk, d]`` (``hk`` divides
    ``h``: grouped heads share their keys), each query restricted to its keys ``index [b, sq, topk]`` where
    ``valid``. ``scale``: SDPA's default ``1/sqrt(d)``; ``step``: queries per block (from the budget)."""
    b, h, sq, d = q.shape
    hk, topk = k.shape[1], index.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    if step is None:
        step = block_size(sq, b * topk * (hk * (k.shape[-1] + v.shape[-1]) + 2 * h))
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    outs = []
    for lo in range(0, sq, step):
        args = (q[:, :, lo:lo + step], k, v, index[:, lo:lo + step], valid[:, lo:lo + step], scale)
        outs.append(checkpoint(_block, *args, use_reentrant=False) if grad else _block(*args))
    return torch.cat(outs, 2) if len(outs) > 1 else outs[0]


def head_summed_probs(q, k, index, valid, scale, step=None):
    """``[b, sq, topk]`` fp32 (no gradient): the attention probabilities of ``q`` over its chosen keys, summed
    over this rank's heads (the indexer loss's target before its sum over tp)."""
    b, h, sq, d = q.shape
    hk, topk = k.shape[1], index.shape[-1]
    if step is None:
        step = block_size(sq, b * topk * (hk * k.shape[-1] + 2 * h))
    out = []
    with torch.no_grad():
        for lo in range(0, sq, step):
            kg = gather_keys(k, index[:, lo:lo + step])
            qg = q[:, :, lo:lo + step].reshape(b, hk, h // hk, -1, d)
            logits = torch.einsum("bjgcd,bjckd->bjgck", wide(qg), wide(kg)) * scale
            probs = torch.softmax(logits.masked_fill(~valid[:, None, None, lo:lo + step], float("-inf")), dim=-1)
            out.append(probs.sum((1, 2)))
    return torch.cat(out, 1)


def chosen_index_scores(q, k, w, index, scale):
    """``[b, c, topk]`` fp32 index scores of queries ``q [c, b, hi, di]`` (head weights ``w [c, b, hi]``) over
    their chosen keys of ``k [sk, b, di]`` (``scale``: ``1/sqrt(di)``), differentiable: the indexer's score of
    the dense reference at those keys."""
    kg = gather_keys(k.permute(1, 0, 2).unsqueeze(1), index).squeeze(1)  # [b, c, topk, di]
    dots = torch.einsum("qbhd,bqkd->bqhk", wide(q), wide(kg)) * scale
    return torch.einsum("qbh,bqhk->bqk", w, F.relu(dots))


def sparse_indexer_kl(kl_fn, qi, ki, wi, probs, index, valid, step=None):
    """The indexer loss's per-query KL ``[b, sq]`` (``kl_fn(scores, probs, valid)``) over the chosen keys, by
    blocks of queries recomputed in backward (one block's gathered indexer keys at a time)."""
    sq, b, hi, di = qi.shape
    topk = index.shape[-1]
    if step is None:
        step = block_size(sq, b * topk * (di + 2 * hi))

    def block(q, k, w, idx, p, ok):
        return kl_fn(chosen_index_scores(q, k, w, idx, di ** -0.5), p, ok)

    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (qi, ki, wi))
    out = []
    for lo in range(0, sq, step):
        args = (qi[lo:lo + step], ki, wi[lo:lo + step], index[:, lo:lo + step], probs[:, lo:lo + step],
                valid[:, lo:lo + step])
        out.append(checkpoint(block, *args, use_reentrant=False) if grad else block(*args))
    return torch.cat(out, 1)
