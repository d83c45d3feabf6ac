"""Muon: momentum, then each hidden matrix's update orthogonalised by Newton-Schulz, on whole logical
matrices whatever the layout.

Per matrix ``W`` of shape ``m x n`` with gradient ``G`` (after clipping) and momentum buffer ``B``::

    B <- mu B + G;   U = G + mu B (Nesterov) or B
    O = NS5(U)                          (the orthogonal factor of U: U = P S Q^T -> about P Q^T)
    W <- W (1 - lr wd) - lr * 0.2 sqrt(max(m, n)) * O

``NS5``: ``X = U / (|U|_F + 1e-7)`` (transposed so that rows <= columns), then 5 times
``A = X X^T;  X = a X + (b A + c A A) X`` with ``(a, b, c) = (3.4445, -4.7750, 2.0315)``. The factor
``0.2 sqrt(max(m, n))`` gives the update about the RMS of AdamW's (0.2 to 0.4), so the same ``lr`` and
``weight_decay`` serve both (Moonlight's choice). Fused weights are orthogonalised per logical part
(``ParamMeta.fused_rows``: query, key, value of a fused QKV; gate and up of a SwiGLU fc1), the routed experts'
``[E, out, in]`` per expert.

Distributed: a parameter lives in pieces, its tensor-parallel shard (``meta.split_dim``) cut into flat
ranges over the shard group of the data-parallel engine (ZeRO-1/2/3, HSDP; the whole local shard on
every rank without sharding). The momentum is elementwise, so it lives in the pieces. The matrices of a
pipeline stage are dealt round-robin to owners ``(shard rank, tp rank)``; for each matrix: the shard
group reduces the pieces (zeros elsewhere: exact) into the local shard on the owner's shard rank, the tp
group gathers the shards on the owner, which runs Newton-Schulz on the whole matrix, scatters the tp
shards back and the shard group broadcasts; each rank keeps its piece. So each matrix is orthogonalised
once per shard group (HSDP replicas each do their own copy), and a rank holds at most one whole matrix
beyond its own state at a time.

Muon takes the layers' matrices and the routed experts' (parameter roles ``matrix`` and ``expert_matrix``);
AdamW the rest: embeddings and their copies on other stages, the output layer, router and gates, norms,
biases.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megand.core.optimizer.checks import in_unit_interval, require
from megand.core.optimizer.grad_norm import clip_grads
from megand.core.optimizer.record import OptimizerRecord
from megand.core.sharding import EXPERT_MATRIX, MATRIX

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The approximate orthogonal factor of ``g`` (``[..., m, n]``, a batch of matrices), computed in
    ``dtype`` and returned in ``g``'s dtype."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    if transposed:
        x = x.mT
    return x.to(g.dtype)


def update_scale(rows: int, cols: int) -> float:
    return 0.2 * math.sqrt(max(rows, cols))


def orthogonalize(full: torch.Tensor, fused_rows, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Muon's scaled update of a whole parameter (``[out, in]`` or the experts' ``[E, out, in]``), per
    logical part of its rows when fused (``fused_rows``: rows of each part in one repeating unit)."""
    if not fused_rows:
        return newton_schulz(full, steps, dtype) * update_scale(*full.shape[-2:])
    lead, (out, cols) = full.shape[:-2], full.shape[-2:]
    unit = sum(fused_rows)
    units = full.reshape(*lead, out // unit, unit, cols)
    result = torch.empty_like(units)
    start = 0
    for rows in fused_rows:
        part = units[..., start: start + rows, :].reshape(*lead, (out // unit) * rows, cols)
        o = newton_schulz(part, steps, dtype) * update_scale(*part.shape[-2:])
        result[..., start: start + rows, :] = o.reshape(*lead, out // unit, rows, cols)
        start += rows
    return result.reshape(full.shape)


class MuonParam:
    """One Muon parameter on this rank: its pieces (none when another shard rank holds all of it) and the
    groups to assemble its whole matrix over."""

    def __init__(self, param, pieces, shard_group, sharded: bool, tp_group, index: int):
        self.param, self.pieces, self.index = param, pieces, index
        self.shard_group = shard_group if shard_group is not None and dist.get_world_size(shard_group) > 1 else None
        self.sharded = sharded
        meta = param.meta
        self.split_dim = meta.split_dim if (tp_group is not None and meta.tp_size > 1) else None
        self.tp_group = tp_group if self.split_dim is not None else None
        self.fused_rows = getattr(meta, "fused_rows", None)

    def _owner(self):
        """(shard rank, tp rank) that orthogonalises this matrix: round-robin over the stage's matrices."""
        s = dist.get_world_size(self.shard_group) if self.shard_group else 1
        t = dist.get_world_size(self.tp_group) if self.tp_group else 1
        return self.index % s, (self.index // s) % t

    def step(self, updates: list[torch.Tensor], steps: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """``updates``: this rank's momentum-updated pieces (fp32, flat); returns the orthogonalised,
        scaled pieces (collective over the shard and tp groups)."""
        p = self.param
        owner_s, owner_t = self._owner()
        my_s = dist.get_rank(self.shard_group) if self.shard_group else 0
        device = updates[0].device if updates else p.device
        local = torch.zeros(p.shape, dtype=torch.float32, device=device)
        flat = local.view(-1)
        for piece, u in zip(self.pieces, updates):
            flat[piece.lo: piece.hi] = u
        if self.shard_group is not None and self.sharded:
            dist.reduce(local, dst=dist.get_global_rank(self.shard_group, owner_s), group=self.shard_group)
        if my_s == owner_s:
            local = self._whole_matrix_step(local, owner_t, steps, dtype)
        if self.shard_group is not None:
            dist.broadcast(local, src=dist.get_global_rank(self.shard_group, owner_s), group=self.shard_group)
        flat = local.view(-1)
        return [flat[piece.lo: piece.hi] for piece in self.pieces]

    def _whole_matrix_step(self, local, owner_t, steps, dtype):
        if self.tp_group is None:
            return orthogonalize(local, self.fused_rows, steps, dtype)
        group, dim = self.tp_group, self.split_dim
        size, owner = dist.get_world_size(group), dist.get_global_rank(group, owner_t)
        mine = dist.get_rank(group) == owner_t
        shards = [torch.empty_like(local) for _ in range(size)] if mine else None
        dist.gather(local, shards, dst=owner, group=group)
        out = list(orthogonalize(torch.cat(shards, dim), self.fused_rows, steps, dtype).chunk(size, dim)) if mine else None
        result = torch.empty_like(local)
        dist.scatter(result, [o.contiguous() for o in out] if mine else None, src=owner, group=group)
        return result


class MuonUpdate:
    """Momentum (Nesterov), Newton-Schulz of each whole matrix, decoupled weight decay. Newton-Schulz runs
    in fp32 for fp32 parameters, in bf16 otherwise (as published)."""

    def __init__(self, named_params, pieces, cfg, ddp, topo):
        self.cfg = cfg
        self.ns_dtype = torch.float32 if all(buf.dtype == torch.float32 for buf in ddp.buffers) else torch.bfloat16
        tp_group = topo.tp_group if topo.tp_size > 1 else None
        # in the stage's parameter order (the same on every rank: the order of the collectives)
        self.params = [MuonParam(p, [x for x in pieces if x.param is p], ddp.bucket_of[p].buffer.reduce.group,
                                 ddp.distributed, tp_group, i) for i, (_, p) in enumerate(named_params)]
        self.pieces = pieces

    def step(self, lr: float, grad_norm: float) -> None:
        c = self.cfg
        clip_grads([x.grad for x in self.pieces], grad_norm, c.clip_grad)
        mu, decay = c.muon_momentum, 1.0 - lr * c.weight_decay
        for mp in self.params:
            updates = []
            for x in mp.pieces:
                buf = x.state["momentum"]
                buf.mul_(mu).add_(x.grad)
                updates.append(x.grad.add(buf, alpha=mu) if c.muon_nesterov else buf)
            for x, o in zip(mp.pieces, mp.step(updates, c.muon_ns_steps, self.ns_dtype)):
                (x.main.mul_(decay) if x.decay else x.main).add_(o, alpha=-lr)

    def set_step(self, steps: int) -> None:
        pass


def newton_schulz_flops(rows: int, cols: int, steps: int = 5) -> float:
    """FLOPs of :func:`newton_schulz` on one m x n matrix (m <= n after the transpose): per iteration
    ``X X^T`` (2 m^2 n), ``A A`` (2 m^3) and ``B X`` (2 m^2 n)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


# 36 bytes per element: read grad and momentum, write momentum, the Nesterov update written and read back,
# read and write the param; the model copy and the grad norm's read
def check_muon(o) -> None:
    in_unit_interval(o, "muon_momentum")
    require(o.muon_ns_steps >= 1, f"optim.muon_ns_steps={o.muon_ns_steps} must be >= 1")


MUON = OptimizerRecord(name="muon", state=("momentum",), roles=frozenset({MATRIX, EXPERT_MATRIX}), update=MuonUpdate,
                       update_bytes=36, fallback="adamw", matrix_flops=newton_schulz_flops,
                       matrix_step="Muon Newton-Schulz", check=check_muon)
