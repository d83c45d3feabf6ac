"""Per-step values by name: each is declared where it is produced, with the rule that combines it over
the ranks, and a set of them crosses the ranks in as few collectives as its rules allow.

A producer returns :class:`Metric` records. Every rank declares the same names (a rank that holds none
of a value declares it as the rule's neutral value), so :func:`reduce_metrics` packs them in one
rank-independent order, by name, into float64 tensors:

- when a record needs every rank's value (``ranks``), one all-gather carries them all, and the host
  combines each by its rule;
- else one all-reduce per op: a sum (``sum``, and ``mean``: a sum of values over a sum of counts) and a
  max (``max``), only the ops declared.

The result is read to the host once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megand.core.tensor_parallel.mappings import all_gather_flat

SUM, MEAN, MAX, RANKS = "sum", "mean", "max", "ranks"
# the all-reduce op each rule rides on (ranks: none, it is gathered)
REDUCE_OPS = {SUM: dist.ReduceOp.SUM, MEAN: dist.ReduceOp.SUM, MAX: dist.ReduceOp.MAX}


@dataclass(frozen=True)
class Metric:
    """One rank's value of a named per-step metric and how the ranks' values combine."""

    name: str
    value: torch.Tensor | float  # this rank's value: a 0-d device tensor (nothing read) or a host number
    reduce: str = SUM  # sum | mean | max | ranks (the list of every rank's value, in rank order)
    count: torch.Tensor | float = 1.0  # mean: this rank's share of the denominator
    integer: bool = False  # reported as an int

    def __post_init__(self):
        if self.reduce not in (*REDUCE_OPS, RANKS):
            raise ValueError(f"metric {self.name}: reduce={self.reduce!r}, expected one of sum, mean, max, ranks")


def _packed(metrics: list[Metric], device) -> torch.Tensor:
    """The metrics' values (and a mean's count after its value), float64, on ``device``: host numbers are
    fills, never copies."""
    parts = []
    for m in metrics:
        for v in ((m.value, m.count) if m.reduce == MEAN else (m.value,)):
            parts.append(v.detach().double().reshape(1) if isinstance(v, torch.Tensor)
                         else torch.full((1,), float(v), dtype=torch.float64, device=device))
    return torch.cat(parts)


def _combine(m: Metric, rows: list[list[float]], at: int):
    """``m``'s result from ``rows`` (one per rank, or one already all-reduced), its value at column ``at``."""
    values = [row[at] for row in rows]
    if m.reduce == RANKS:
        return values
    if m.reduce == MEAN:
        total, count = sum(values), sum(row[at + 1] for row in rows)
        out = total / count if count else 0.0  # nothing counted on any rank: 0
    else:
        out = max(values) if m.reduce == MAX else sum(values)
    return int(out) if m.integer else out


def reduce_metrics(metrics: list[Metric], device, world_size: int, group=None) -> dict:
    """Collective over ``group`` (default: the world, of ``world_size`` ranks): every metric combined over
    the ranks by its rule, ``{name: value}`` in the order given, identical on every rank."""
    if not metrics:
        return {}
    names = [m.name for m in metrics]
    if len(set(names)) != len(names):
        raise ValueError(f"metric names declared twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
    ordered = sorted(metrics, key=lambda m: m.name)  # the same on every rank
    gather = world_size > 1 and any(m.reduce == RANKS for m in ordered)
    # the packs: one for the all-gather (or a lone rank), else one per all-reduce op
    ops = [None] if gather or world_size == 1 else [op for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX)
                                                     if any(REDUCE_OPS[m.reduce] == op for m in ordered)]
    packs = [[m for m in ordered if op is None or REDUCE_OPS[m.reduce] == op] for op in ops]
    column, at = {}, 0
    for m in (m for pack in packs for m in pack):
        column[m.name] = at
        at += 2 if m.reduce == MEAN else 1
    tensors = [_packed(pack, device) for pack in packs]
    if gather:
        (mine,) = tensors
        everyone = torch.empty(world_size * mine.numel(), dtype=mine.dtype, device=mine.device)
        all_gather_flat(everyone, mine, group=group)
        rows = everyone.view(world_size, -1).tolist()
    else:
        for op, tensor in zip(ops, tensors):
            if op is not None:
                dist.all_reduce(tensor, op=op, group=group)
        rows = [torch.cat(tensors).tolist()]
    by_name = {m.name: m for m in ordered}
    return {name: _combine(by_name[name], rows, column[name]) for name in names}
