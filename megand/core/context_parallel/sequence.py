"""Load-balanced sequence split for causal context parallelism.

The sequence is cut into 2·cp chunks and cp rank r holds chunks r and 2·cp-1-r, concatenated in that
order. Under a causal mask an early chunk attends to few keys and a late chunk to many; pairing the
r-th earliest with the r-th latest gives every rank the same attention work.
"""

import torch
import torch.distributed as dist


def split_for_cp(x: torch.Tensor, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """The local part of ``x`` along ``dim`` for ``cp_rank``: chunks cp_rank and 2·cp_size-1-cp_rank of 2·cp_size."""
    if cp_size == 1:
        return x
    if x.size(dim) % (2 * cp_size) != 0:
        raise ValueError(f"size {x.size(dim)} of dim {dim} is not divisible by 2 * cp = {2 * cp_size}")
    chunks = x.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=dim)


def merge_cp_shards(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of ``split_for_cp`` over all ranks: ``shards[r]`` is rank r's local part; returns the full tensor."""
    cp_size = len(shards)
    halves = [shard.chunk(2, dim=dim) for shard in shards]
    # global chunk j < cp is the first half of rank j; chunk j >= cp the second half of rank 2cp-1-j
    ordered = [halves[j][0] for j in range(cp_size)] + [halves[2 * cp_size - 1 - j][1] for j in range(cp_size, 2 * cp_size)]
    return torch.cat(ordered, dim=dim)


def gather_from_cp(x: torch.Tensor, dim: int, cp_group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather the local parts over ``cp_group`` into the full tensor in global order (tests and tools; no autograd)."""
    shards = [torch.empty_like(x) for _ in range(dist.get_world_size(cp_group))]
    dist.all_gather(shards, x.contiguous(), group=cp_group)
    return merge_cp_shards(shards, dim)


def cp_positions(seq_length: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Global token indices of the local tokens of ``cp_rank`` (LongTensor of length seq_length / cp_size)."""
    return split_for_cp(torch.arange(seq_length, device=device), 0, cp_rank, cp_size)
