"""The communication of tensor and sequence parallelism, one named autograd function per collective.

These are the f/g operators of the Megatron paper. Each forward collective has its adjoint in backward:
identity <-> all-reduce, split <-> all-gather, all-gather <-> reduce-scatter. Activations are laid out
``[seq, batch, hidden]`` so that sequence-parallel shards are contiguous slices of dim 0.
"""

import torch
import torch.distributed as dist

# torch 2.12 renamed the flat-tensor collectives; the old names remain for the older builds GPU users bring.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_reduce(x, group):
    if dist.get_world_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_last(x, group):
    size = dist.get_world_size(group)
    if size == 1:
        return x
    return x.chunk(size, dim=-1)[dist.get_rank(group)].contiguous()


def _gather_last(x, group):
    size = dist.get_world_size(group)
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _split_first(x, group):
    size = dist.get_world_size(group)
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by the tensor-parallel size {size}")
    return x.chunk(size, dim=0)[dist.get_rank(group)].contiguous()


def _gather_first(x, group):
    size = dist.get_world_size(group)
    if size == 1:
        return x
    out = torch.empty((x.shape[0] * size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_first(x, group):
    size = dist.get_world_size(group)
    if size == 1:
        return x
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out, x.contiguous(), group=group)
    return out


class CopyToTensorParallel(torch.autograd.Function):
    """f: identity forward, all-reduce of the input gradient backward (entry of a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: all-reduce forward, identity backward (exit of a row-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class AllReduceBoth(torch.autograd.Function):
    """All-reduce forward and backward: a sum over tp of rank-local parts that every rank reads into outputs of
    its own (the sum of squares of a norm over a tp-split width): each part's gradient sums all ranks' reads."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class GatherFromTensorParallel(torch.autograd.Function):
    """All-gather the last dim forward, keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class ScatterToSequenceParallel(torch.autograd.Function):
    """Keep this rank's sequence shard forward, all-gather the sequence backward (after the embedding)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


class GatherFromSequenceParallel(torch.autograd.Function):
    """All-gather the sequence forward, reduce-scatter backward (entry of a column-parallel layer under sp).

    ``to_model_parallel=False`` makes backward a plain split: used where the gathered tensor feeds a
    computation that is replicated, not partitioned, across tp (e.g. the final gather before the loss).
    """

    @staticmethod
    def forward(ctx, x, group, to_model_parallel=True):
        ctx.group, ctx.to_model_parallel = group, to_model_parallel
        return _gather_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.to_model_parallel:
            return _reduce_scatter_first(grad, ctx.group), None, None
        return _split_first(grad, ctx.group), None, None


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Reduce-scatter the sequence forward, all-gather backward (exit of a row-parallel layer under sp)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


def copy_to_tp(x, group):
    return CopyToTensorParallel.apply(x, group)


def reduce_from_tp(x, group):
    if dist.get_world_size(group) == 1:  # nothing to sum: skip the autograd node and its copy
        return x
    return ReduceFromTensorParallel.apply(x, group)


def all_reduce_both(x, group):
    return AllReduceBoth.apply(x, group)


def gather_from_tp(x, group):
    return GatherFromTensorParallel.apply(x, group)


def scatter_to_sp(x, group):
    return ScatterToSequenceParallel.apply(x, group)


def gather_from_sp(x, group, to_model_parallel=True):
    return GatherFromSequenceParallel.apply(x, group, to_model_parallel)


def reduce_scatter_to_sp(x, group):
    return ReduceScatterToSequenceParallel.apply(x, group)
