"""Parameters tagged with how they are sharded (nanotron's idea).

Every parameter carries a :class:`ParamMeta`: the full tensor it is a slice of, the dimension split
across tensor-parallel ranks, how the full tensor is initialised, and whether it is a copy of another
parameter. From that one tag follow layout-independent initialisation, grad-norm de-duplication,
sequence-parallel gradient reduction, tied-weight synchronisation and resharding checkpoints.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamMeta:
    full_shape: tuple[int, ...]  # the full, unpadded tensor
    split_dim: int | None = None  # dim split across tp; None: replicated on every tp rank
    tp_rank: int = 0
    tp_size: int = 1
    init: str = "normal"  # normal | ones | zeros
    init_std: float = 0.02
    # Replicated across tp but fed sequence shards under sequence parallelism: each tp rank holds a
    # partial gradient, summed over tp before the optimizer (norm weights, biases after a reduce-scatter).
    sequence_parallel_grad: bool = False
    copy_of: str | None = None  # name of the parameter this one duplicates (tied output layer on the last stage)
    # One of the two copies of a weight tied across pipeline stages (word embedding and output layer):
    # their gradients are summed over the embedding group so the copies stay equal.
    embedding_group_grad: bool = False

    def local_slice(self) -> tuple[slice, ...]:
        """This rank's slice of the full tensor. Along a padded dim (vocab) it may hold fewer rows than
        the local parameter; the rest is padding."""
        if self.split_dim is None:
            return tuple(slice(None) for _ in self.full_shape)
        full = self.full_shape[self.split_dim]
        per_rank = -(-full // self.tp_size)
        start = min(self.tp_rank * per_rank, full)
        stop = min(start + per_rank, full)
        return tuple(slice(start, stop) if d == self.split_dim else slice(None) for d in range(len(self.full_shape)))

    @property
    def counted_in_norm(self) -> bool:
        """Whether this rank counts the parameter in the global norm: every element counts once over tp."""
        return self.copy_of is None and (self.split_dim is not None or self.tp_rank == 0)


def tag(param: torch.nn.Parameter, meta: ParamMeta) -> torch.nn.Parameter:
    param.meta = meta
    return param


def meta_of(param: torch.Tensor) -> ParamMeta:
    return param.meta


def retag(param: torch.nn.Parameter, **changes) -> None:
    param.meta = dataclasses.replace(param.meta, **changes)


def param_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}/{name}".encode())


def full_init(meta: ParamMeta, seed: int, name: str) -> torch.Tensor:
    """The full tensor that ``name`` is a slice of, identical whatever the layout."""
    if meta.init == "ones":
        return torch.ones(meta.full_shape)
    if meta.init == "zeros":
        return torch.zeros(meta.full_shape)
    generator = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(meta.full_shape).normal_(0.0, meta.init_std, generator=generator)


@torch.no_grad()
def init_parameters(module: torch.nn.Module, seed: int) -> None:
    """Fill every tagged parameter with its slice of the full tensor drawn from (seed, name).

    A copy (``copy_of``) draws from its original's name, so tied weights start equal. Padding rows
    beyond the full tensor are zero.
    """
    for name, param in module.named_parameters():
        meta = meta_of(param)
        local = full_init(meta, seed, meta.copy_of or name)[meta.local_slice()]
        param.zero_()
        param[tuple(slice(0, n) for n in local.shape)].copy_(local)
