"""Self-attention with heads and query groups split across tensor-parallel ranks.

The fused QKV weight is laid out per query group: ``[groups, q_heads_per_group + 2, head_dim, hidden]``
(the group's query heads, then its key head, then its value head). Splitting its rows evenly across tp
gives each rank whole groups, so the layout of the full weight does not depend on tp. ``fuse_qkv`` and
``split_qkv`` convert between that layout and separate query/key/value weights (checkpoint conversion).

When tp exceeds the key/value heads (multi-query attention, or few groups), each rank holds ``heads / tp``
query heads and the key and value head of their group, which the ``tp / groups`` consecutive ranks of that
group hold alike (:class:`SharedKVProjection`): the key/value rows are replicated over that run of ranks
(``ParamMeta.tp_replicas``), while both parts stay pieces of the one fused weight of every other layout.

Generation passes a layer's KV cache (:mod:`megand.core.transformer.kv_cache`): the keys and values of
earlier tokens are kept, so each new token costs one position instead of the whole window.
"""

import torch

from megand.core.attention_masks import local_attention
from megand.core.context_parallel import all_gather_attention, ring_attention, ulysses_attention
from megand.core.sdpa import heads_first
from megand.core.sharding import BIAS, HEADS, MATRIX, ParamMeta, retag
from megand.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, checkpoint
from megand.core.tensor_parallel.gemm import DEFAULT, use_policy
from megand.core.tensor_parallel.layers import _param, column_parallel_linear, divide
from megand.core.transformer.kv_cache import LayerKVCache, cached_attention
from megand.core.transformer.norms import Norm, SplitRMSNorm
from megand.core.transformer.rope import apply_rope


# parallel.cp_comm -> the attention over a context-parallel group
CP_ATTENTION = {"p2p": ring_attention, "all_gather": all_gather_attention, "a2a": ulysses_attention}
def fuse_qkv(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, query_groups: int,
             head_dim: int | None = None) -> torch.Tensor:
    """The fused QKV weight (or bias) from full query ``[heads * d, ...]``, key and value
    ``[groups * d, ...]`` tensors: each query group's query heads, then its key head, then its value head. A
    layer whose values are its keys (``v`` None) has no value rows, one that reads another layer's keys and
    values (``k`` and ``v`` None, ``head_dim`` given) only its queries."""
    rest = q.shape[1:]
    head_dim = k.shape[0] // query_groups if head_dim is None else head_dim
    parts = [q.reshape(query_groups, -1, head_dim, *rest)]  # [groups, q_per_group, d, ...]
    parts += [t.reshape(query_groups, 1, head_dim, *rest) for t in (k, v) if t is not None]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, num_heads: int, query_groups: int,
              kv_rows: int = 2) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Inverse of :func:`fuse_qkv`: full query ``[heads * d, ...]``, key and value ``[groups * d, ...]`` (None
    where the layer has none: ``kv_rows`` key/value heads per group, 2, 1 or 0)."""
    rest = qkv.shape[1:]
    q_per_group = num_heads // query_groups
    qkv = qkv.reshape(query_groups, q_per_group + kv_rows, -1, *rest)  # [groups, q_per_group + kv_rows, d, ...]
    q = qkv[:, :q_per_group].reshape(-1, *rest)
    kv = [qkv[:, q_per_group + j].reshape(-1, *rest) for j in range(kv_rows)]
    return q, *(kv + [None] * (2 - kv_rows))


class SharedKVProjection(torch.nn.Module):
    """The fused QKV projection when tp is a multiple of the query groups ``G``: rank ``r`` computes query heads
    ``[r, r + 1) * heads / tp`` and the key and value head of their group ``r // (tp / G)``. Its two weights
    are rows of the full fused weight (``[G, q_per_group + 2, d, hidden]``): the query rows its own, the
    key/value rows replicated over the group's ``tp / G`` ranks, which sum their partial gradients (each saw
    only its own query heads). Output: ``[s, b, (q_local + kv_rows) * d]``, the layout of one group of the
    fused projection with ``q_local`` query heads."""

    def __init__(self, cfg, topo, q_per_group, *, bias, dtype, device, kv_rows=2):
        super().__init__()
        tp, rank, d, h = topo.tp_size, topo.tp_rank, cfg.head_dim, cfg.hidden_size
        self.tp_group, self.sequence_parallel = topo.tp_group, cfg.sequence_parallel
        run = tp // cfg.query_groups  # the ranks sharing one key/value head
        group, j = divmod(rank, run)
        q_local = q_per_group // run
        unit = (q_per_group + kv_rows) * d  # one group's rows of the fused weight (kv_rows: key, and value)
        q_rows = (group * unit + j * q_local * d, group * unit + (j + 1) * q_local * d)
        kv_rows = (group * unit + q_per_group * d, (group + 1) * unit)
        full = cfg.query_groups * unit

        def part(rows, role, init, name, replicas, *cols):
            meta = ParamMeta((full, *cols), 0, rank, tp, init=init, init_std=cfg.init_std, role=role, rows=rows,
                             part_of=name, tp_replicas=replicas)
            return _param((rows[1] - rows[0], *cols), meta, dtype, device)

        self.q_weight = part(q_rows, MATRIX, "normal", "weight", 1, h)
        self.kv_weight = part(kv_rows, MATRIX, "normal", "weight", run, h)
        self.q_bias = part(q_rows, BIAS, "zeros", "bias", 1) if bias else None
        self.kv_bias = part(kv_rows, BIAS, "zeros", "bias", run) if bias else None
        self.set_gemm(DEFAULT)

    def set_gemm(self, policy):
        """Run both products under ``policy`` (a precision recipe), each a column-parallel product."""
        self.q_gemm = use_policy(self.q_weight, policy.bind(self.tp_group, "column"))
        self.kv_gemm = use_policy(self.kv_weight, policy.bind(self.tp_group, "column"))

    def forward(self, x):
        q = column_parallel_linear(x, self.q_weight, self.q_bias, self.tp_group, self.sequence_parallel,
                                   policy=self.q_gemm)
        kv = column_parallel_linear(x, self.kv_weight, self.kv_bias, self.tp_group, self.sequence_parallel,
                                    policy=self.kv_gemm)
        return torch.cat([q, kv], dim=-1)


class AttentionCore(torch.nn.Module):
    """What every attention block shares: causal attention of its heads on this rank, over the context-parallel
    group, within documents, with dropout and selective recomputation."""

    def __init__(self, cfg, topo, rng, layer_id=0, device=None):
        super().__init__()
        self.cfg, self.rng = cfg, rng
        self.window = cfg.window(layer_id)  # sliding-window attention of this layer (None: full causal)
        self.cp_group = topo.cp_group if topo.cp_size > 1 else None
        self.checkpoint = checkpoint  # selective recomputation's checkpoint (see keep_eager)
        self.sinks = None
        if cfg.attention_sinks:  # one logit per query head: split over tp with the heads
            heads, tp = cfg.num_attention_heads, topo.tp_size
            meta = ParamMeta((heads,), 0, topo.tp_rank, tp, init_std=cfg.init_std, role=BIAS)
            self.sinks = _param((divide(heads, tp, "model.num_attention_heads across tensor-parallel ranks"),), meta,
                                cfg.params_dtype, topo.device if device is None else device)

    def keep_eager(self, eager) -> None:
        """This block is compiled: its selective recomputation runs through ``eager``
        (``torch.compiler.disable``: the compiled caller breaks its graph there), since the checkpoint
        replays the tensor-parallel RNG, which torch.compile cannot trace."""
        self.checkpoint = eager(checkpoint)

    def core(self, q, k, v, documents=None):
        """Causal attention of ``[b, heads, s, d]`` tensors; k and v may have fewer (grouped) heads.
        ``documents``: a :class:`DocumentMask`; tokens then attend only within their document."""
        window = {} if self.window is None else {"window": self.window}
        if self.sinks is not None:
            window["sinks"] = self.sinks
        if self.cp_group is not None:  # the other tokens of the sequence live on the other cp ranks
            attend = CP_ATTENTION[self.cfg.cp_comm]
            if documents is not None:
                return attend(q, k, v, self.cp_group, documents=documents, **window)
            return attend(q, k, v, self.cp_group, **window)
        if documents is not None:  # attention dropout with document masks is refused by the config
            return documents.attend(q, k, v, **window)
        dropout = self.cfg.attention_dropout if self.training else 0.0
        if dropout == 0.0:  # no random state to swap (torch.compile cannot trace the swap: a graph break)
            return local_attention(q, k, v, self.window, sinks=self.sinks)
        with self.rng.fork():  # heads differ across tp ranks, so do their dropout masks
            return local_attention(q, k, v, self.window, dropout_p=dropout)

    def attend(self, q, k, v, documents=None):
        """``core``, recomputed in backward under selective recomputation."""
        if self.cfg.recompute == "selective":
            return self.checkpoint(self.core, q, k, v, documents, rng=self.rng)
        return self.core(q, k, v, documents)


class Attention(AttentionCore):
    """Attention of one layer, of that layer's shape (:meth:`TransformerConfig.layer_config`: a full-attention
    layer may have a head width and key/value heads of its own). Its keys and values: its own (key and value
    heads: ``kv_rows`` 2), its keys' projection as values too (``model.global_k_eq_v``: 1), or an earlier layer's
    (``model.num_kv_shared_layers``: 0), which that layer leaves in ``shared`` (a dict of the model's forward,
    by layer id) after its KV cache, so that generation reads the cached keys of the layer it shares."""

    def __init__(self, cfg, topo, rng, device=None, layer_id=0):
        kv = dict(layer_id=layer_id, kv_rows=cfg.kv_rows(layer_id), kv_source=cfg.kv_source(layer_id),
                  stores_kv=cfg.kv_shared(layer_id))
        cfg = cfg.layer_config(layer_id)
        super().__init__(cfg, topo, rng, layer_id, device)
        self.layer_id, self.kv_rows, self.kv_source, self.stores_kv = kv.values()
        tp = topo.tp_size
        self.q_per_group = divide(cfg.num_attention_heads, cfg.query_groups, "model.num_attention_heads per query group")
        # with the output gate each query group also holds its heads' gates, after its queries
        self.gated = cfg.attention_output_gate
        self.q_rows = self.q_per_group * (2 if self.gated else 1)
        qkv_size = cfg.query_width * (2 if self.gated else 1) + self.kv_rows * cfg.kv_width
        common = dict(tp_group=topo.tp_group, bias=cfg.add_bias, sequence_parallel=cfg.sequence_parallel,
                      dtype=cfg.params_dtype, device=topo.device if device is None else device)
        if tp > cfg.query_groups and self.kv_rows:  # fewer key/value heads than ranks: each shared with neighbours
            divide(tp, cfg.query_groups, "parallel.tp over model.num_query_groups")
            if self.gated:  # a rank's gate rows would be a third part of each group's rows
                raise ValueError(f"model.attention_output_gate with model.num_query_groups={cfg.query_groups} < "
                                 f"parallel.tp={tp}: not supported; use parallel.tp <= {cfg.query_groups}")
            self.qkv = SharedKVProjection(cfg, topo, self.q_per_group, bias=cfg.add_bias or cfg.qkv_bias,
                                          dtype=cfg.params_dtype, device=common["device"], kv_rows=self.kv_rows)
            self.local_groups, self.q_per_group = 1, divide(cfg.num_attention_heads, tp,
                                                            "model.num_attention_heads across tensor-parallel ranks")
            self.q_rows = self.q_per_group
        else:
            if tp > cfg.query_groups:  # queries only (another layer's keys and values): each rank its heads
                divide(tp, cfg.query_groups, "parallel.tp over model.num_query_groups")
                self.local_groups, self.q_per_group = 1, divide(cfg.num_attention_heads, tp,
                                                                "model.num_attention_heads across tensor-parallel ranks")
                self.q_rows = self.q_per_group
            else:
                self.local_groups = divide(cfg.query_groups, tp, "model.num_query_groups across tensor-parallel ranks")
            self.qkv = ColumnParallelLinear(cfg.hidden_size, qkv_size, init_std=cfg.init_std,
                                            **dict(common, bias=cfg.add_bias or cfg.qkv_bias))
            # per query group: its queries, its key, its value (optimizers that treat each matrix whole read this)
            retag(self.qkv.weight, fused_rows=(self.q_per_group * cfg.head_dim,) * (2 if self.gated else 1)
                  + (cfg.head_dim,) * self.kv_rows)
        self.proj = RowParallelLinear(cfg.query_width, cfg.hidden_size,
                                      init_std=cfg.init_std / (2 * cfg.num_layers) ** 0.5,
                                      **dict(common, bias=cfg.add_bias or cfg.attention_out_bias))
        self.q_norm = self.k_norm = None
        if cfg.qk_norm and cfg.qk_norm_scope == "projection":  # over all heads: split with them over tp
            if tp > cfg.query_groups or cfg.norm_unit_offset:
                raise ValueError(f"model.qk_norm_scope=projection with model.num_query_groups={cfg.query_groups} < "
                                 f"parallel.tp={tp} or model.norm_unit_offset={cfg.norm_unit_offset}: not supported")
            norm = dict(eps=cfg.norm_eps, tp_group=topo.tp_group if tp > 1 else None, tp_rank=topo.tp_rank,
                        tp_size=tp, dtype=cfg.params_dtype, device=common["device"])
            self.q_norm, self.k_norm = SplitRMSNorm(cfg.query_width, **norm), SplitRMSNorm(cfg.kv_width, **norm)
        elif cfg.qk_norm:  # replicated over tp, while each tp rank normalises its own heads: partial gradients
            norm = dict(eps=cfg.norm_eps, input_split=HEADS, tp_rank=topo.tp_rank, tp_size=tp,
                        dtype=cfg.params_dtype, device=common["device"])
            norm["unit_offset"] = cfg.norm_unit_offset
            self.q_norm, self.k_norm = Norm("rmsnorm", cfg.head_dim, **norm), Norm("rmsnorm", cfg.head_dim, **norm)
        if not self.kv_rows:  # the keys come normalised from the layer that made them
            self.k_norm = None
        # query_pre_attn_scalar: the scores' scale folded into the queries (every attention path, cp included,
        # then keeps its own 1/sqrt(head_dim))
        scalar = cfg.query_pre_attn_scalar
        self.q_scale = 1.0 if scalar is None else (cfg.head_dim / scalar) ** 0.5

    def forward(self, x, rope=None, cache: LayerKVCache | None = None, documents=None, shared=None):
        """``shared``: the model forward's keys and values by layer id, which this layer reads (``kv_source``)
        or leaves for later layers (``stores_kv``)."""
        s, b = x.shape[0], x.shape[1]  # under sequence parallelism qkv gathers the full local sequence
        qkv = self.qkv(x)
        s = qkv.shape[0]
        qkv = qkv.view(s, b, self.local_groups, self.q_rows + self.kv_rows, self.cfg.head_dim)
        q = qkv[:, :, :, : self.q_per_group].reshape(s, b, -1, self.cfg.head_dim)
        gate = qkv[:, :, :, self.q_per_group: self.q_rows].reshape(s, b, -1) if self.gated else None
        if self.q_norm is not None:
            q = self.q_norm(q)
        if rope is not None:
            q = apply_rope(q, *rope)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        q = heads_first(q) if rope is not None else q.permute(1, 2, 0, 3)  # [b, heads, s, d]
        if self.kv_source is not None:  # an earlier layer's keys and values (its cached ones in generation)
            k, v = shared[self.kv_source]
        else:
            k = qkv[:, :, :, self.q_rows]
            v = k if self.kv_rows == 1 else qkv[:, :, :, self.q_rows + 1]  # values equal to the keys' projection
            if self.k_norm is not None:
                k = self.k_norm(k)
            if self.cfg.v_norm:  # Gemma 4: each value head normalised, without a weight (before the KV cache)
                v = torch.nn.functional.rms_norm(v, (v.shape[-1],), eps=self.cfg.norm_eps)
            if rope is not None:
                k = apply_rope(k, *rope)
            k = heads_first(k) if rope is not None else k.permute(1, 2, 0, 3)  # [b, groups, s, d]
            v = v.permute(1, 2, 0, 3)
            if cache is not None:
                k, v = cache.append(k, v)
            if self.stores_kv:
                shared[self.layer_id] = k, v
        if cache is not None:
            out = cached_attention(q, k, v, window=self.window, sinks=self.sinks)
        else:
            out = self.attend(q, k, v, documents)
        out = out.permute(2, 0, 1, 3).reshape(s, b, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.proj(out)
