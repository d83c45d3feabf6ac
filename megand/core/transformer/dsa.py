"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): a lightning indexer scores every (query, key) pair and each
query attends only to its ``model.dsa_index_topk`` best keys (causal; within its document).

The indexer has its own small projections (``dsa_index_heads`` heads of ``dsa_index_head_dim``)::

    q_i    = wq(q_latent)                   [heads_i, d_i]   q_latent: the latent attention's normalised query latent
    k_i    = layernorm(wk(x))               [d_i]            one key per token, shared by the indexer heads
    w      = weights(x) / sqrt(heads_i)     [heads_i]
    score  = sum_h w_h * relu(q_i[h] . k_i / sqrt(d_i))

both with RoPE (rotate-half) on their first ``qk_rope_head_dim`` dims. The selection is not differentiable:
the main loss sends no gradient to the indexer. Its own training signal is DeepSeek's auxiliary indexer loss
(``model.dsa_indexer_loss_coeff``): per query, the KL divergence from the main attention's distribution over
the selected keys (its probabilities summed over heads, L1-normalised; detached) to the softmax of the
indexer's scores over the same keys, with the indexer's inputs detached, so that loss trains the indexer
only. megand takes its mean over the micro-batch's tokens (DeepSeek writes the sum; the coefficient absorbs
the count).

Tensor parallelism: the indexer is replicated on every tp rank, not split by its heads. Its score is a sum
over all indexer heads; splitting them would all-reduce an ``s x s`` score matrix per layer and make the
selection depend on the tp summation order (a different top-k on a near tie), while the replicated
projections are small (``heads_i x d_i`` from the query latent). Every rank then selects the same keys.

The attention takes one of two paths (:func:`megand.core.transformer.dsa_sparse.use_sparse`, the one rule): the
reference, a dense boolean mask of the selected keys with SDPA, O(s^2) memory and FLOPs (as the dense attention
it replaces: short sequences, attention dropout, generation), or the top-k path of
:mod:`megand.core.transformer.dsa_sparse` (the same keys, memory O(s·k)), on one process and under context
parallelism. Under cp each rank gathers the indexer keys and the attention's keys and values of the whole sequence (its queries'
top-k may lie on any rank), selects among all earlier keys exactly as one process does, and attends its own
queries (backward: the gathered keys' and values' gradients are summed over cp and each rank keeps its own).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megand.core.attention_masks import visible
from megand.core.metrics import MEAN, Metric
from megand.core.context_parallel.sequence import cp_positions, merge_cp_shards, split_for_cp
from megand.core.sharding import MATRIX, ParamMeta, split_by_tokens, tag
from megand.core.tensor_parallel import gather_from_sp
from megand.core.transformer.dsa_sparse import (head_summed_probs, select_topk, sparse_attention, sparse_indexer_kl,
                                                use_sparse, wide)
from megand.core.transformer.moe import AddLossGradient, in_recompute
from megand.core.transformer.norms import Norm
from megand.core.transformer.rope import apply_rope

INDEXER_NORM_EPS = 1e-6  # DeepSeek's indexer key LayerNorm (not the model's norm_eps)


def _replicated(shape, topo, input_split, init_std, dtype, device):
    meta = ParamMeta(shape, None, topo.tp_rank, topo.tp_size, init_std=init_std, input_split=input_split,
                     role=MATRIX)
    return tag(torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device)), meta)


class GatherFromCP(torch.autograd.Function):
    """All-gather ``[s_local, ...]`` over cp into the whole sequence in global order; backward: the gradient
    summed over cp (every rank's queries read every rank's keys), this rank's tokens kept."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        shards = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, x.contiguous(), group=group)
        return merge_cp_shards(shards, 0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return split_for_cp(grad, 0, dist.get_rank(ctx.group), dist.get_world_size(ctx.group)), None


class Indexer(torch.nn.Module):
    """The lightning indexer of one layer: ``attention.indexer.{wq, wk, k_norm, weights}`` (replicated over tp).

    Under sequence parallelism ``wk`` and ``weights`` project the rank's sequence shard (partial gradients,
    ``input_split="tokens"``) and their outputs are gathered; ``wq`` and ``k_norm`` then run on the whole
    local sequence on every tp rank (whole gradients)."""

    def __init__(self, cfg, topo, device):
        super().__init__()
        self.heads, self.dim, self.rope_dim = cfg.dsa_index_heads, cfg.dsa_index_head_dim, cfg.qk_rope_head_dim
        self.topk = cfg.dsa_index_topk
        self.tp_group, self.sp = topo.tp_group, cfg.sequence_parallel and topo.tp_size > 1
        split = split_by_tokens(cfg.sequence_parallel)
        dtype, std = cfg.params_dtype, cfg.init_std
        self.wq = _replicated((self.heads * self.dim, cfg.q_lora_rank), topo, None, std, dtype, device)
        self.wk = _replicated((self.dim, cfg.hidden_size), topo, split, std, dtype, device)
        self.k_norm = Norm("layernorm", self.dim, eps=INDEXER_NORM_EPS, tp_rank=topo.tp_rank, tp_size=topo.tp_size,
                           dtype=dtype, device=device)
        self.weights = _replicated((self.heads, cfg.hidden_size), topo, split, std, dtype, device)
        self.loss_scale = 1.0  # the indexer loss's gradient: loss scale / micro-batches of the step (start_step)
        # the ranks holding one micro-batch's tokens (cp shards, data-parallel replicas): the loss is their mean
        self.microbatch_ranks = topo.microbatch_ranks
        self.loss_sum = None  # this rank's share, over the step (made by start_step, where the weights live)
        self.terms = 0  # (layer, micro-batch) terms in loss_sum: a host count

    def forward(self, x, q_latent, rope):
        """``x``: the layer's input (the rank's sp shard under sp), ``q_latent [s, b, q_lora_rank]`` (the whole
        local sequence). -> queries ``[b, s, heads, d]``, keys ``[b, s, d]``, head weights ``[b, s, heads]``
        (fp32), inputs detached: only the indexer loss trains the indexer."""
        x, q_latent = x.detach(), q_latent.detach()
        k, w = F.linear(x, self.wk), F.linear(x, self.weights)
        if self.sp:
            k, w, q_latent = (gather_from_sp(t, self.tp_group, False) for t in (k, w, q_latent))
        s, b = q_latent.shape[:2]
        q = F.linear(q_latent, self.wq).view(s, b, self.heads, self.dim)
        k = self.k_norm(k).unsqueeze(2)
        if rope is not None:  # rotate-half on the first qk_rope_head_dim dims (unlike the MLA heads' last dims)
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k.squeeze(2), wide(w) * self.heads ** -0.5

    def attend(self, block, x, q, k, v, q_latent, rope, cache=None, documents=None):
        """The sparse attention of ``block`` (the latent attention): its queries ``q [b, heads, s, d]`` over the
        whole sequence's keys and values ``k, v [b, heads, sk, d]`` (gathered over cp; the cache's under
        generation), restricted to each query's selected keys."""
        qi, ki, wi = self(x, q_latent, rope)
        if cache is not None:  # generation (one process): the indexer keys of every token so far
            ki = cache.append_index(ki)
            sk = ki.shape[0]
            q_pos, k_pos = torch.arange(sk - qi.shape[0], sk, device=q.device), torch.arange(sk, device=q.device)
        else:
            ki = gather_cp(ki, block.cp_group)
            q_pos, k_pos = dsa_positions(qi.shape[0], block.cp_group, q.device)
        dropout = block.cfg.attention_dropout if block.training else 0.0
        if cache is None and dropout == 0.0 and use_sparse(k_pos.numel(), self.topk):
            return self.attend_topk(block, q, k, v, qi, ki, wi, q_pos, k_pos, documents)
        allowed = allowed_keys(q_pos, k_pos, documents, block.window)
        index_scores = self.scores(qi, ki, wi)
        chosen = self.select(index_scores.detach(), allowed)
        mask = chosen[:, None]  # [b, 1, sq, sk]: the same keys for every head
        if block.cfg.recompute == "selective" and cache is None:
            out = block.checkpoint(self._core, block, q, k, v, mask, rng=block.rng)
        else:
            out = self._core(block, q, k, v, mask)
        if self.training and torch.is_grad_enabled() and cache is None and block.cfg.dsa_indexer_loss_coeff:
            out = AddLossGradient.apply(out, self.indexer_loss(block, q, k, index_scores, chosen), self.loss_scale)
        return out

    def attend_topk(self, block, q, k, v, qi, ki, wi, q_pos, k_pos, documents):
        """The top-k path (:mod:`megand.core.transformer.dsa_sparse`): the same keys as the dense mask, gathered per
        block of queries. Its blocks are recomputed in backward already: selective recomputation has nothing
        more to drop."""
        b = q.shape[0]
        with torch.no_grad():
            index, valid = select_topk(lambda lo, hi: self.scores(qi[lo:hi], ki, wi[lo:hi]),
                                       lambda lo, hi: allowed_keys(q_pos[lo:hi], k_pos, documents, block.window),
                                       qi.shape[0], ki.shape[0], self.topk, b * self.heads * ki.shape[0])
        out = sparse_attention(q, k, v, index, valid)
        if self.training and torch.is_grad_enabled() and block.cfg.dsa_indexer_loss_coeff:
            probs = head_summed_probs(q, k, index, valid, q.shape[-1] ** -0.5)
            kl = sparse_indexer_kl(indexer_kl, qi, ki, wi, self._summed_over_tp(block, probs), index, valid)
            out = AddLossGradient.apply(out, self._mean_loss(block, kl), self.loss_scale)
        return out

    def _core(self, block, q, k, v, mask):
        dropout = block.cfg.attention_dropout if block.training else 0.0
        if dropout == 0.0:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        with block.rng.fork():  # heads differ across tp ranks, so do their dropout masks
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)

    def indexer_loss(self, block, q, k, index_scores, chosen):
        """This rank's share of the micro-batch's mean indexer loss (its queries' KL summed, over the micro-batch's
        global tokens): the target is the main attention's probabilities summed over every head (over tp)."""
        with torch.no_grad():
            logits = torch.einsum("bhqd,bhkd->bhqk", wide(q), wide(k)) * q.shape[-1] ** -0.5
            probs = torch.softmax(logits.masked_fill(~chosen[:, None], float("-inf")), dim=-1).sum(1)
        return self._mean_loss(block, indexer_kl(index_scores, self._summed_over_tp(block, probs), chosen))

    @staticmethod
    def _summed_over_tp(block, probs):
        """The main attention's probabilities summed over this rank's heads -> over every head."""
        if block.tp_group is not None and dist.get_world_size(block.tp_group) > 1:
            dist.all_reduce(probs, group=block.tp_group)
        return probs

    def _mean_loss(self, block, kl):
        """This rank's share of the micro-batch's mean indexer loss from its queries' KL ``[b, sq]``."""
        tokens = kl.numel() * self.microbatch_ranks
        loss = kl.sum() / tokens
        if not in_recompute() and self.loss_sum is not None:
            self.loss_sum += loss.detach()
            self.terms += 1
        return block.cfg.dsa_indexer_loss_coeff * loss

    def scores(self, q, k, w):
        """``[b, sq, sk]`` fp32 index scores of queries ``[sq, b, h, d]`` (head weights ``[sq, b, h]``) over keys
        ``[sk, b, d]``."""
        dots = torch.einsum("qbhd,kbd->bqhk", wide(q), wide(k)) * self.dim ** -0.5
        return torch.einsum("qbh,bqhk->bqk", w, F.relu(dots))

    def select(self, scores, allowed):
        """``[b, sq, sk]`` boolean: the ``topk`` best allowed keys of each query (all of them when it has fewer).
        Ties break towards the earlier key (a stable sort), whatever the layout."""
        allowed = allowed.expand_as(scores)
        scores = scores.masked_fill(~allowed, float("-inf"))
        k = min(self.topk, scores.shape[-1])
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
        chosen = torch.zeros_like(allowed).scatter_(-1, order, True)
        return chosen & allowed


def allowed_keys(q_pos, k_pos, documents, window=None):
    """``[b or 1, sq, sk]``: keys a query may see (causal, within its document)."""
    allowed = visible(q_pos, k_pos, window)[None]
    if documents is not None:
        ids = documents.ids
        allowed = allowed & (ids[:, q_pos][:, :, None] == ids[:, k_pos][:, None, :])
    return allowed


def indexer_kl(index_scores, probs, chosen):
    """DeepSeek's indexer loss per query ``[b, sq]``: KL(p || softmax(index scores)) over the chosen keys, p the
    main attention's probabilities ``[b, sq, sk]`` summed over heads (detached), L1-normalised there."""
    target = probs.masked_fill(~chosen, 0.0)
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
    log_q = torch.log_softmax(index_scores.masked_fill(~chosen, float("-inf")), dim=-1)
    kl = target * (torch.log(target.clamp_min(1e-30)) - log_q)
    return kl.masked_fill(~chosen, 0.0).sum(-1)


def dsa_positions(s_local, cp_group, device):
    """Global positions of this rank's tokens and of the whole sequence under cp (load-balanced chunks)."""
    if cp_group is None:
        pos = torch.arange(s_local, device=device)
        return pos, pos
    size, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    return cp_positions(s_local * size, rank, size, device), torch.arange(s_local * size, device=device)


def gather_cp(x, cp_group):
    """``x [s_local, ...]`` as the whole sequence (an identity without cp)."""
    return x if cp_group is None else GatherFromCP.apply(x, cp_group)


def indexers(chunks) -> list[Indexer]:
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, Indexer)]


def start_step(chunks, loss_scale: float, num_microbatches: int) -> None:
    """Before a step: zero the indexer losses' sums and set their gradient scale (each micro-batch's loss counts
    1/num_microbatches, like its share of the LM loss; times the fp16 loss scale)."""
    for m in indexers(chunks):
        m.loss_sum = torch.zeros((), dtype=torch.float32, device=m.wq.device)
        m.terms = 0
        m.loss_scale = float(loss_scale) / num_microbatches


def step_metrics(chunks, cfg, topo) -> list[Metric]:
    """``indexer_loss``: the step's indexer loss, the mean over layers and micro-batches. Each rank holds its
    share of each micro-batch's mean (its cp shard and data-parallel replica), identical over tp: tp rank 0's
    shares are summed, and each term counted once (on the first rank of its micro-batch: every replica's first cp
    rank under uneven batch shares, where each replica's micro-batches are its own)."""
    if cfg.dsa_index_topk is None or not cfg.dsa_indexer_loss_coeff:
        return []
    layers = indexers(chunks)
    mine = topo.tp_rank == 0
    total = sum((m.loss_sum for m in layers), torch.zeros((), device=topo.device)) if mine and layers else 0.0
    first = mine and topo.cp_rank == 0 and (topo.dp_rank == 0 or topo.layout.uneven_shares)
    return [Metric("indexer_loss", total, MEAN, count=float(sum(m.terms for m in layers)) if first else 0.0)]
