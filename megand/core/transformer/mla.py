"""Multi-head latent attention (DeepSeek-V2/V3), heads split across tensor-parallel ranks.

Per token, the keys and values of every head come from one ``kv_lora_rank``-wide latent, and the queries
from a ``q_lora_rank``-wide one (or straight from the hidden state when ``q_lora_rank`` is null)::

    q      = q_up(rmsnorm(q_down(x)))             [heads, qk_nope_head_dim + qk_rope_head_dim]
    latent, k_rope = kv_down(x)                   [kv_lora_rank], [qk_rope_head_dim]: one rotary key for all heads
    k_nope, v = kv_up(rmsnorm(latent))            [heads, qk_nope_head_dim], [heads, v_head_dim]
    k      = (k_nope, rope(k_rope)),  q = (q_nope, rope(q_rope))

Tensor parallelism: the up projections are column-parallel (each rank its heads) and the output projection
row-parallel, as in the standard attention. The down projections and the latent norms are small and
replicated: every rank projects the tokens it holds. Without sequence parallelism those are all tokens and
each up projection's entry sums the latent's gradient over tp, so the replicated weights' gradients are
already whole. Under sequence parallelism each rank projects its sequence shard (the latent is gathered, not
the wider hidden state, inside the up projection): their gradients are partial, ``input_split="tokens"``.
The shared rotary key feeds every head: its gradient is summed over tp on the way back (an all-reduce, or
the reduce-scatter of its sequence gather under sp).

The attention kernels take one head width for q, k and v: when ``v_head_dim`` differs from the query/key
width the narrower side is zero-padded (zero value columns give zero outputs, cut off after; zero query/key
columns leave the scores unchanged), so every path (fused kernels, the context-parallel ones, documents)
runs unchanged. Generation caches the normalised latent and the rotated key (``kv_lora_rank +
qk_rope_head_dim`` numbers per token and layer instead of ``heads x (qk + v)``) and expands them per step.
"""

import torch
import torch.nn.functional as F

from megand.core.sharding import MATRIX, ParamMeta, split_by_tokens, tag
from megand.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, copy_to_tp, gather_from_sp
from megand.core.tensor_parallel.layers import divide
from megand.core.transformer.attention import AttentionCore
from megand.core.transformer.dsa import Indexer, gather_cp
from megand.core.transformer.kv_cache import LayerKVCache, cached_attention
from megand.core.transformer.norms import Norm
from megand.core.transformer.rope import apply_rope


def _replicated(shape, topo, input_split, init_std, dtype, device):
    meta = ParamMeta(shape, None, topo.tp_rank, topo.tp_size, init_std=init_std, input_split=input_split,
                     role=MATRIX)
    return tag(torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device)), meta)


class LatentAttention(AttentionCore):
    def __init__(self, cfg, topo, rng, device=None, layer_id=0):
        super().__init__(cfg, topo, rng, layer_id)
        device = topo.device if device is None else device
        self.tp_group, self.sp = topo.tp_group, cfg.sequence_parallel
        self.local_heads = divide(cfg.num_attention_heads, topo.tp_size, "model.num_attention_heads across "
                                  "tensor-parallel ranks")
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.latent = cfg.kv_lora_rank
        split = split_by_tokens(cfg.sequence_parallel)  # the replicated weights' input: all tokens or a shard
        common = dict(tp_group=topo.tp_group, bias=False, sequence_parallel=cfg.sequence_parallel,
                      dtype=cfg.params_dtype, device=device)
        norm = dict(eps=cfg.norm_eps, input_split=split, tp_rank=topo.tp_rank, tp_size=topo.tp_size,
                    dtype=cfg.params_dtype, device=device)
        h, std = cfg.hidden_size, cfg.init_std
        if cfg.q_lora_rank is None:
            self.q_down = self.q_down_norm = None
            self.q_up = ColumnParallelLinear(h, cfg.query_width, init_std=std, **common)
        else:
            self.q_down = _replicated((cfg.q_lora_rank, h), topo, split, std, cfg.params_dtype, device)
            self.q_down_norm = Norm("rmsnorm", cfg.q_lora_rank, **norm)
            self.q_up = ColumnParallelLinear(cfg.q_lora_rank, cfg.query_width, init_std=std, **common)
        self.kv_down = _replicated((self.latent + self.rope_dim, h), topo, split, std, cfg.params_dtype, device)
        self.kv_down_norm = Norm("rmsnorm", self.latent, **norm)
        self.kv_up = ColumnParallelLinear(self.latent, cfg.num_attention_heads * (self.nope + self.v_dim),
                                          init_std=std, **common)
        self.proj = RowParallelLinear(cfg.attention_output_width, h, init_std=std / (2 * cfg.num_layers) ** 0.5,
                                      **common)
        # the kernels' default 1/sqrt(width) becomes the model's scale (DeepSeek's yarn temperature) on q
        self.q_factor = cfg.attention_temperature * (max(cfg.head_dim, self.v_dim) / cfg.head_dim) ** 0.5
        # DeepSeek Sparse Attention (V3.2): each query attends to the keys its indexer selects
        self.indexer = Indexer(cfg, topo, device) if cfg.dsa_index_topk is not None else None

    def queries(self, x, rope):
        """``[s, b, local heads, qk]`` (the full local sequence under sp), and the normalised query latent (this
        rank's tokens; None without one)."""
        if self.q_down is None:
            q_latent, q = None, self.q_up(x)
        else:
            q_latent = self.q_down_norm(F.linear(x, self.q_down))
            q = self.q_up(q_latent)
        q = q.view(q.shape[0], q.shape[1], self.local_heads, -1)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        if rope is not None:
            q_rope = apply_rope(q_rope, *rope)
        return torch.cat([q_nope, q_rope], dim=-1), q_latent

    def latents(self, x, rope):
        """The normalised latent (this rank's tokens) and the rotated shared key ``[s, b, 1, rope]`` (the full
        local sequence under sp)."""
        latent, k_rope = F.linear(x, self.kv_down).split([self.latent, self.rope_dim], dim=-1)
        if self.sp:
            k_rope = gather_from_sp(k_rope, self.tp_group)
        else:
            k_rope = copy_to_tp(k_rope, self.tp_group)
        k_rope = k_rope.unsqueeze(2)
        if rope is not None:
            k_rope = apply_rope(k_rope, *rope)
        return self.kv_down_norm(latent), k_rope

    def keys_values(self, latent, k_rope):
        """Keys ``[s, b, local heads, qk]`` and values ``[s, b, local heads, v]`` of the latent."""
        kv = self.kv_up(latent)
        kv = kv.view(kv.shape[0], kv.shape[1], self.local_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, self.local_heads, -1)], dim=-1)
        return k, v

    def forward(self, x, rope=None, cache: LayerKVCache | None = None, documents=None):
        b = x.shape[1]
        q, q_latent = self.queries(x, rope)
        latent, k_rope = self.latents(x, rope)
        if cache is not None:  # generation (one process): the latents of every token so far
            latent, k_rope = cache.append(latent.permute(1, 0, 2).unsqueeze(1), k_rope.permute(1, 2, 0, 3))
            latent, k_rope = latent.squeeze(1).permute(1, 0, 2), k_rope.permute(2, 0, 1, 3)
        k, v = self.keys_values(latent, k_rope)
        if self.indexer is not None and cache is None:  # a query's selected keys may lie on any cp rank
            k, v = gather_cp(k, self.cp_group), gather_cp(v, self.cp_group)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        q = q * self.q_factor if self.q_factor != 1.0 else q
        width = max(q.shape[-1], self.v_dim)  # one width for q, k and v (zero padding)
        if q.shape[-1] < width:
            q, k = F.pad(q, (0, width - q.shape[-1])), F.pad(k, (0, width - k.shape[-1]))
        if self.v_dim < width:
            v = F.pad(v, (0, width - self.v_dim))
        if self.indexer is not None:
            out = self.indexer.attend(self, x, q, k, v, q_latent, rope, cache, documents)
        elif cache is not None:
            out = cached_attention(q, k, v, window=self.window)
        else:
            out = self.attend(q, k, v, documents)
        s = out.shape[2]
        out = out[..., : self.v_dim].permute(2, 0, 1, 3).reshape(s, b, -1)
        return self.proj(out)
