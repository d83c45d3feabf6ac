"""Gated DeltaNet (Qwen3-Next / Qwen3.5's linear attention), heads split across tensor-parallel ranks.

Per token (``G`` key heads of width ``dk``, ``r`` value heads of width ``dv`` per key head)::

    q, k, v, z = qkvz(x)                 per key head: q [dk], k [dk], v [r dv], z [r dv]
    b, a       = ba(x)                   per key head: [r], [r]
    q, k, v    = silu(causal depthwise conv of width K over the tokens of (q, k, v))
    beta = sigmoid(b),  g = -exp(A_log) * softplus(a + dt_bias)
    o = gated delta rule (q / |q| / sqrt(dk), k / |k|, v, g, beta)   (megand.core.transformer.delta_rule)
    out = proj(rmsnorm(o) * w * silu(z))                         (the norm per value head)

Tensor parallelism: the in-projections are column-parallel and ``proj`` row-parallel, as attention's. Their
rows (and the convolution's channels, ``A_log``, ``dt_bias``) are laid out per key head, so a contiguous
split over tp gives each rank whole key heads with their value heads, and the full tensors do not depend on
tp. Context parallelism passes the recurrent state (and the convolution's last K-1 inputs) from rank to rank
(:mod:`megand.core.context_parallel.state_passing`). Documents restart the state and the convolution.
Generation keeps the same two things per layer (:class:`~megand.core.transformer.kv_cache.LayerRecurrentCache`)
and continues them token by token with the same code.
"""

import torch
import torch.nn.functional as F

from megand.core.context_parallel.state_passing import pass_state
from megand.core.sharding import BIAS, CONV, HEADS, ParamMeta, retag, tag
from megand.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, checkpoint
from megand.core.tensor_parallel.layers import divide
from megand.core.transformer import delta_rule
from megand.core.transformer.norms import Norm

CHUNK = 64  # tokens per chunk of the chunked form


def wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32 at least (bf16 and fp16 are widened; fp64, for references, stays)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def recurrent_step(x, state, params, args):
    """One stretch of tokens: ``x [b, s, C + 2 Hv]`` (the convolution's input channels, then g and beta per
    value head), ``state = (tail [b, K-1, C], S [b, Hv, dk, dv])``: the convolution's K-1 previous inputs and
    the recurrent state; ``params = (conv weight [C, K],)``; ``args = (shape, docs)`` with ``shape = (G, dk, r,
    dv)`` and ``docs [b, K-1+s]`` the document ids of the previous K-1 tokens and these (or None). Returns
    (``o [b, s, Hv, dv]``, the state after)."""
    (weight,), ((groups, dk, r, dv), docs) = params, args
    tail, S = state
    hv, (b, s), kernel = groups * r, x.shape[:2], weight.shape[1]
    width = groups * (2 * dk + r * dv)
    mixed, g, beta = wide(x).split([width, hv, hv], dim=-1)
    xe = torch.cat([wide(tail), mixed], dim=1)
    conv = 0
    for i in range(kernel):  # out_t = sum_i w_i x_{t-K+1+i}, within the token's document
        term = wide(weight[:, i]) * xe[:, i:i + s]
        if docs is not None:
            term = term * (docs[:, i:i + s] == docs[:, kernel - 1:])[..., None]
        conv = conv + term
    qkv = F.silu(conv).view(b, s, groups, -1)
    q, k, v = qkv.split([dk, dk, r * dv], dim=-1)
    q, k = (t.repeat_interleave(r, dim=2) for t in (q, k))  # each key head serves its r value heads
    q, k = delta_rule.l2norm(q) * dk ** -0.5, delta_rule.l2norm(k)
    v = v.reshape(b, s, hv, dv)
    q, k, v, g, beta = (t.transpose(1, 2) for t in (q, k, v, g, beta))
    within, prev = (None, None) if docs is None else (docs[:, kernel - 1:], docs[:, kernel - 2])
    o, S = delta_rule.chunked(q, k, v, g, beta, S, within, prev, chunk=CHUNK)
    return o.transpose(1, 2), (xe[:, s:].to(tail.dtype), S)


class GatedDeltaNet(torch.nn.Module):
    def __init__(self, cfg, topo, rng, device=None, layer_id=0):
        super().__init__()
        device = topo.device if device is None else device
        self.cfg, self.rng, tp = cfg, rng, topo.tp_size
        heads, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.groups = divide(heads, tp, "model.linear_num_key_heads across tensor-parallel ranks")
        self.r = divide(cfg.linear_num_value_heads, heads, "model.linear_num_value_heads per key head")
        self.dk, self.dv, self.kernel = dk, dv, cfg.linear_conv_kernel
        self.hv = self.groups * self.r  # this rank's value heads
        self.width = self.groups * (2 * dk + self.r * dv)  # this rank's convolution channels
        common = dict(tp_group=topo.tp_group, bias=False, sequence_parallel=cfg.sequence_parallel,
                      dtype=cfg.params_dtype, device=device)
        self.qkvz = ColumnParallelLinear(cfg.hidden_size, heads * (2 * dk + 2 * self.r * dv), init_std=cfg.init_std,
                                         **common)
        retag(self.qkvz.weight, fused_rows=(dk, dk, self.r * dv, self.r * dv))
        self.ba = ColumnParallelLinear(cfg.hidden_size, heads * 2 * self.r, init_std=cfg.init_std, **common)
        retag(self.ba.weight, fused_rows=(self.r, self.r))

        def param(shape, local, role, **init):  # split over tp along dim 0: this rank's key heads
            meta = ParamMeta(shape, 0, topo.tp_rank, tp, role=role, **init)
            return tag(torch.nn.Parameter(torch.empty(local, dtype=cfg.params_dtype, device=device)), meta)

        # the depthwise taps at the scale of torch's Conv1d default (fan-in K); per key head (q, k, v) channels
        self.conv = param((heads * (2 * dk + self.r * dv), self.kernel), (self.width, self.kernel), CONV,
                          init_std=self.kernel ** -0.5)
        # per value head: decay rate exp(A_log) = 1 and time-step bias 1 at init (transformers' dt_bias)
        self.a_log = param((cfg.linear_num_value_heads,), (self.hv,), BIAS, init="zeros")
        self.dt_bias = param((cfg.linear_num_value_heads,), (self.hv,), BIAS, init="ones")
        self.norm = Norm("rmsnorm", dv, eps=cfg.norm_eps, input_split=HEADS, tp_rank=topo.tp_rank, tp_size=tp,
                         dtype=cfg.params_dtype, device=device)
        self.proj = RowParallelLinear(cfg.linear_num_value_heads * dv, cfg.hidden_size,
                                      init_std=cfg.init_std / (2 * cfg.num_layers) ** 0.5, **common)
        self.cp_group = topo.cp_group if topo.cp_size > 1 else None
        self.cp_rank, self.cp_size = topo.cp_rank, topo.cp_size
        self.checkpoint = checkpoint
        self.eager = lambda fn: fn

    def keep_eager(self, eager) -> None:
        """Compiled: selective recomputation and the context-parallel walk (point-to-point calls) run eagerly."""
        self.checkpoint, self.eager = eager(checkpoint), eager

    @property
    def shape(self):
        return (self.groups, self.dk, self.r, self.dv)

    def zero_state(self, batch, dtype, device):
        return (torch.zeros(batch, self.kernel - 1, self.width, dtype=dtype, device=device),
                torch.zeros(batch, self.hv, self.dk, self.dv, dtype=torch.promote_types(dtype, torch.float32),
                            device=device))

    def _docs(self, documents, start, length):
        """Document ids ``[b, K-1+length]`` of the K-1 tokens before global index ``start`` and the ``length``
        from it (-1 before the sequence)."""
        ids = documents.ids
        lo = start - (self.kernel - 1)
        before = ids[:, max(lo, 0):start]
        pad = torch.full((ids.shape[0], -lo if lo < 0 else 0), -1, dtype=ids.dtype, device=ids.device)
        return torch.cat([pad, before, ids[:, start:start + length]], dim=1)

    def core(self, x, weight, documents=None):
        """``o [b, s, Hv, dv]`` of the local tokens ``x [b, s, C + 2 Hv]`` (the context-parallel load-balanced
        chunks under cp)."""
        b, s = x.shape[:2]
        zero = self.zero_state(b, x.dtype, x.device)
        if self.cp_group is None:
            docs = None if documents is None else self._docs(documents, 0, s)
            return recurrent_step(x, zero, (weight,), (self.shape, docs))[0]
        half, P = s // 2, self.cp_size
        if half < self.kernel - 1:
            raise ValueError(f"{half} tokens per context-parallel chunk: Gated DeltaNet's convolution needs at least "
                             f"model.linear_conv_kernel - 1 = {self.kernel - 1}")
        starts = (self.cp_rank * half, (2 * P - 1 - self.cp_rank) * half)
        args = tuple((self.shape, None if documents is None else self._docs(documents, st, half)) for st in starts)
        return self.eager(pass_state)(recurrent_step, x, (weight,), zero, args, self.cp_group)

    def forward(self, x, rope=None, cache=None, documents=None):
        """``x [s, b, h]`` (a sequence shard under sp); ``rope`` is unused (no positions: the recurrence
        orders the tokens); ``cache``: a :class:`LayerRecurrentCache` (generation)."""
        qkvz, ba = self.qkvz(x), self.ba(x)
        s, b = qkvz.shape[:2]
        qkvz = qkvz.view(s, b, self.groups, -1)
        mixed, z = qkvz.split([2 * self.dk + self.r * self.dv, self.r * self.dv], dim=-1)
        beta, a = wide(ba.view(s, b, self.groups, 2, self.r)).unbind(3)
        beta = beta.sigmoid().reshape(s, b, self.hv)
        g = -wide(self.a_log).exp() * F.softplus(a.reshape(s, b, self.hv) + wide(self.dt_bias))
        x_in = torch.cat([wide(mixed.reshape(s, b, -1)), g, beta], dim=-1).transpose(0, 1)  # [b, s, C + 2 Hv]
        if cache is not None:
            o, state = recurrent_step(x_in, cache.state, (self.conv,), (self.shape, None))
            cache.update(state, s)
        elif self.cfg.recompute == "selective":
            o = self.checkpoint(self.core, x_in, self.conv, documents, rng=self.rng)
        else:
            o = self.core(x_in, self.conv, documents)
        o = o.transpose(0, 1).to(x.dtype)  # [s, b, Hv, dv]
        z = z.reshape(s, b, self.hv, self.dv)
        out = (wide(self.norm(o)) * F.silu(wide(z))).to(x.dtype)
        return self.proj(out.reshape(s, b, -1))
