"""Tensor-parallel layers. Each layer owns a contiguous slice of its full weight along one dim.

ColumnParallelLinear splits the output features (weight rows), RowParallelLinear the input features
(weight columns); a column layer followed by a row layer needs one all-reduce (or, under sequence
parallelism, one all-gather before and one reduce-scatter after). The communication is in
:mod:`megand.core.tensor_parallel.mappings`; here it is only called.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megand.core.sharding import ParamMeta, split_by_tokens, tag
from megand.core.tensor_parallel.gemm import DEFAULT, GemmPolicy, use_policy, weight_grad_target, weight_grad_pass
from megand.core.vocab_padding import padded_vocab_size
from megand.core.tensor_parallel.mappings import (
    _reduce_scatter_first,
    copy_to_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}: {numerator} is not divisible by {denominator}")
    return numerator // denominator


class ParallelLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` of a parallel layer, its three products run by the layer's
    :class:`~megand.core.tensor_parallel.gemm.GemmPolicy` (the precision recipe) and its weight gradient
    added straight into the fp32 accumulator of the data-parallel engine when there is one (:mod:`.wgrad`).

    Under sequence parallelism ``x`` is this rank's sequence shard: it is all-gathered over the tp ranks
    here and only the shard is stored for backward, which all-gathers it again for the weight gradient and
    reduce-scatters the input gradient (Megatron's sequence-parallel linear). Autograd around a plain
    gather would store the gathered input, tp times the shard, in every column-parallel layer of every
    micro-batch in flight."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, fuse_wgrad, policy=DEFAULT):
        ctx.group, ctx.sequence_parallel, ctx.policy = group, sequence_parallel, policy
        ctx.wgrad_target = weight_grad_target(weight, fuse_wgrad)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        full = policy.gather_input(x, group) if sequence_parallel else policy.input_operand(x.reshape(-1, x.shape[-1]))
        return policy.forward(full, weight, bias).view(-1, *x.shape[1:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        policy = ctx.policy
        grad_x = grad_weight = grad_bias = None
        flat_grad = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[0]:
            grad_x = policy.input_grad(flat_grad, weight)
            if ctx.sequence_parallel:
                grad_x = _reduce_scatter_first(grad_x.view(-1, *x.shape[1:]), ctx.group)
            else:
                grad_x = grad_x.view_as(x)
        if ctx.needs_input_grad[1]:  # after the input gradient: ZeRO-3 may free the weight once it is added
            full = policy.regather_input(x, ctx.group) if ctx.sequence_parallel else x.reshape(-1, x.shape[-1])
            grad_weight = weight_grad_pass(policy, weight, flat_grad, full, ctx.wgrad_target)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = flat_grad.sum(0)
        return grad_x, grad_weight, grad_bias, None, None, None, None


def column_parallel_linear(x, weight, bias, group, sequence_parallel: bool, fuse_wgrad: bool = True,
                           policy: GemmPolicy = DEFAULT):
    """A column-parallel product: ``x`` is the full activation (replicated over tp) or, under sequence
    parallelism, this rank's sequence shard. ``fuse_wgrad=False`` for a weight that is also read elsewhere
    in the same backward (its gradient then arrives once, summed by autograd)."""
    if not sequence_parallel:
        x = copy_to_tp(x, group)
    return ParallelLinear.apply(x, weight, bias, group, sequence_parallel, fuse_wgrad, policy)


def _param(shape, meta, dtype, device):
    return tag(torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device)), meta)


class ColumnParallelLinear(torch.nn.Module):
    """``y = x A^T + b`` with A split by rows: this rank computes ``out_features / tp`` outputs.

    Input: the full activation (replicated over tp), or under sequence parallelism this rank's sequence
    shard, all-gathered here. Output: this rank's slice of the features (not gathered). ``padded_out``
    lets the output dim exceed ``out_features`` (vocab padding, a multiple of tp); padded rows stay zero.
    """

    def __init__(self, in_features, out_features, *, tp_group, bias=True, sequence_parallel=False,
                 init_std=0.02, padded_out=None, dtype=torch.float32, device=None):
        super().__init__()
        tp_size, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        local_out = divide(padded_out or out_features, tp_size, "output features across tensor-parallel ranks")
        padded = padded_out if padded_out and padded_out != out_features else None
        self.weight = _param((local_out, in_features), ParamMeta((out_features, in_features), 0, tp_rank, tp_size,
                                                                 init_std=init_std, padded_size=padded), dtype, device)
        self.bias = _param((local_out,), ParamMeta((out_features,), 0, tp_rank, tp_size, init="zeros",
                                                   padded_size=padded), dtype, device) if bias else None
        self.set_gemm(DEFAULT)

    def set_gemm(self, policy: GemmPolicy):
        """Run this layer's products under ``policy`` (a precision recipe)."""
        self.gemm = use_policy(self.weight, policy.bind(self.tp_group, "column"))

    def forward(self, x):
        return column_parallel_linear(x, self.weight, self.bias, self.tp_group, self.sequence_parallel,
                                      policy=self.gemm)


class RowParallelLinear(torch.nn.Module):
    """``y = x A^T + b`` with A split by columns: the input is this rank's feature slice (the output of a
    column-parallel layer), the partial products are summed over tp (reduce-scattered along the sequence
    under sequence parallelism). The bias is replicated and added once, after the reduction."""

    def __init__(self, in_features, out_features, *, tp_group, bias=True, sequence_parallel=False,
                 init_std=0.02, dtype=torch.float32, device=None):
        super().__init__()
        tp_size, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        local_in = divide(in_features, tp_size, "input features across tensor-parallel ranks")
        self.weight = _param((out_features, local_in), ParamMeta((out_features, in_features), 1, tp_rank, tp_size,
                                                                 init_std=init_std), dtype, device)
        self.bias = _param((out_features,), ParamMeta((out_features,), None, tp_rank, tp_size, init="zeros",
                                                      input_split=split_by_tokens(sequence_parallel)),
                           dtype, device) if bias else None
        self.set_gemm(DEFAULT)

    def set_gemm(self, policy: GemmPolicy):
        """Run this layer's products under ``policy`` (a precision recipe)."""
        self.gemm = use_policy(self.weight, policy.bind(self.tp_group, "row"))

    def forward(self, x):
        y = ParallelLinear.apply(x, self.weight, None, self.tp_group, False, True, self.gemm)
        y = reduce_scatter_to_sp(y, self.tp_group) if self.sequence_parallel else reduce_from_tp(y, self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split by vocab rows. Each rank looks up the ids in its range (zeros elsewhere);
    the partial results are summed over tp by the caller (all-reduce, or reduce-scatter under sp)."""

    def __init__(self, vocab_size, hidden_size, *, tp_group, init_std=0.02, padded_size=None, dtype=torch.float32,
                 device=None):
        """``padded_size``: the table's rows with padding, a multiple of tp (default: the vocab rounded
        up to one)."""
        super().__init__()
        tp_size, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        self.tp_group, self.vocab_size = tp_group, vocab_size
        padded = padded_size or padded_vocab_size(vocab_size, tp_size)
        local_rows = divide(padded, tp_size, "padded vocabulary rows across tensor-parallel ranks")
        self.vocab_start = tp_rank * local_rows
        self.vocab_end = self.vocab_start + local_rows
        meta = ParamMeta((vocab_size, hidden_size), 0, tp_rank, tp_size, init_std=init_std,
                         padded_size=padded if padded != vocab_size else None)
        self.weight = _param((local_rows, hidden_size), meta, dtype, device)

    def forward(self, ids):
        return vocab_parallel_lookup(ids, self.weight, self.tp_group)


def vocab_parallel_lookup(ids, weight, tp_group):
    """This rank's partial lookup of ``ids`` in its rows ``weight`` of a vocab-split table (zeros for the ids
    of other ranks' rows); the caller sums it over tp. Also for a module reading another's table (a later
    lookup in the word embedding, under its own hooks)."""
    tp_size = dist.get_world_size(tp_group)
    if tp_size == 1:
        return F.embedding(ids, weight)
    start = dist.get_rank(tp_group) * weight.shape[0]
    outside = (ids < start) | (ids >= start + weight.shape[0])
    local_ids = (ids - start).masked_fill(outside, 0)
    return F.embedding(local_ids, weight).masked_fill(outside.unsqueeze(-1), 0.0)
