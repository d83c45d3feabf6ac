"""Every tensor-parallel layer and mapping against the dense one-process computation, at tp=2 and tp=4.

Each rank draws the same full tensors from seeded generators, takes its shard (weights through the
parameter's ``meta.local_slice()``), runs the parallel forward and backward, and compares the output, the
input gradients and the weight gradients with autograd on the full tensors in one process (fp32).
One launch per tp size runs every check.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megand.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    padded_vocab_size,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
    vocab_parallel_cross_entropy,
)
from megand.tools.spawn import run_distributed

SEQ, BATCH, HIDDEN, FFN = 32, 2, 64, 128
VOCAB = 51  # divisible by neither 2 nor 4: the last rank's shard is short, the table is padded
TOL = dict(atol=1e-6, rtol=1e-5)


def randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def close(actual, expected, what):
    torch.testing.assert_close(actual, expected.detach(), **TOL, msg=lambda m: f"{what}: {m}")


class Ranks:
    def __init__(self, group):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def seq_shard(self, t):
        return t.chunk(self.size, dim=0)[self.rank]

    def per_rank(self, *shape, seed, scale=1.0):
        """One tensor per tp rank (every rank draws them all, so the dense computation sees them too)."""
        return [randn(*shape, seed=seed + r, scale=scale) for r in range(self.size)]


@torch.no_grad()
def load(layer, **full):
    """Each named parameter becomes this rank's slice of the full tensor; padding rows stay zero."""
    for name, tensor in full.items():
        param = getattr(layer, name)
        local = tensor[param.meta.local_slice()]
        param.zero_()
        param[tuple(slice(0, n) for n in local.shape)].copy_(local)


def check_column(r: Ranks, sp: bool):
    w, b = randn(FFN, HIDDEN, seed=1, scale=0.1), randn(FFN, seed=2)
    x_full, grad_out = randn(SEQ, BATCH, HIDDEN, seed=3), randn(SEQ, BATCH, FFN, seed=4)
    dw, db, dx = leaf(w), leaf(b), leaf(x_full)
    dense = F.linear(dx, dw, db)
    (dense * grad_out).sum().backward()

    layer = ColumnParallelLinear(HIDDEN, FFN, tp_group=r.group, bias=True, sequence_parallel=sp)
    load(layer, weight=w, bias=b)
    rows = layer.weight.meta.local_slice()[0]
    x = leaf(r.seq_shard(x_full) if sp else x_full)
    y = layer(x)
    what = f"column sp={sp}"
    close(y, dense[..., rows], f"{what} output")
    (y * grad_out[..., rows]).sum().backward()
    close(x.grad, r.seq_shard(dx.grad) if sp else dx.grad, f"{what} input grad")
    close(layer.weight.grad, dw.grad[rows], f"{what} weight grad")
    close(layer.bias.grad, db.grad[rows], f"{what} bias grad")


def check_row(r: Ranks, sp: bool):
    w, b = randn(HIDDEN, FFN, seed=11, scale=0.1), randn(HIDDEN, seed=12)
    x_full, grad_out = randn(SEQ, BATCH, FFN, seed=13), randn(SEQ, BATCH, HIDDEN, seed=14)
    dw, db, dx = leaf(w), leaf(b), leaf(x_full)
    dense = F.linear(dx, dw, db)
    (dense * grad_out).sum().backward()

    layer = RowParallelLinear(FFN, HIDDEN, tp_group=r.group, bias=True, sequence_parallel=sp)
    load(layer, weight=w, bias=b)
    cols = layer.weight.meta.local_slice()[1]
    x = leaf(x_full[..., cols])
    y = layer(x)
    what = f"row sp={sp}"
    close(y, r.seq_shard(dense) if sp else dense, f"{what} output")
    (y * (r.seq_shard(grad_out) if sp else grad_out)).sum().backward()
    close(x.grad, dx.grad[..., cols], f"{what} input grad")
    close(layer.weight.grad, dw.grad[:, cols], f"{what} weight grad")
    assert layer.bias.meta.split_dim is None and layer.bias.meta.partial_over_tp == sp, what
    bias_grad = layer.bias.grad.clone()
    if sp:  # each rank holds the gradient of its tokens only; the sum over tp is the full gradient
        close(bias_grad, r.seq_shard(grad_out).sum((0, 1)), f"{what} local bias grad")
        dist.all_reduce(bias_grad, group=r.group)
    close(bias_grad, db.grad, f"{what} bias grad")


def vocab_ids(r: Ranks, seed):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    rows = padded_vocab_size(VOCAB, r.size) // r.size
    edges = [0, rows - 1, rows, VOCAB - 2, VOCAB - 1]  # the first and last id of shards, the last real id
    ids[0, : len(edges)] = torch.tensor(edges)
    return ids


def check_embedding(r: Ranks, reduction: str):
    """The vocab-parallel lookup followed by the reduction its caller does: an all-reduce over tp
    (then a sequence scatter under sequence parallelism, as the GPT embedding does), or a reduce-scatter."""
    w, ids = randn(VOCAB, HIDDEN, seed=21, scale=0.1), vocab_ids(r, 22)
    grad_out = randn(SEQ, BATCH, HIDDEN, seed=23)
    dw = leaf(w)
    dense = F.embedding(ids, dw).transpose(0, 1)  # [s, b, h]
    (dense * grad_out).sum().backward()

    emb = VocabParallelEmbedding(VOCAB, HIDDEN, tp_group=r.group)
    local_rows = padded_vocab_size(VOCAB, r.size) // r.size
    assert emb.weight.shape == (local_rows, HIDDEN)
    assert (emb.vocab_start, emb.vocab_end) == (r.rank * local_rows, (r.rank + 1) * local_rows)
    load(emb, weight=w)
    partial = emb(ids)  # [b, s, h]
    if reduction == "all_reduce":
        y, expected, g = reduce_from_tp(partial, r.group).transpose(0, 1), dense, grad_out
    elif reduction == "all_reduce+scatter_to_sp":
        y = scatter_to_sp(reduce_from_tp(partial, r.group).transpose(0, 1).contiguous(), r.group)
        expected, g = r.seq_shard(dense), r.seq_shard(grad_out)
    else:
        y = reduce_scatter_to_sp(partial.transpose(0, 1).contiguous(), r.group)
        expected, g = r.seq_shard(dense), r.seq_shard(grad_out)
    what = f"embedding + {reduction}"
    close(y, expected, f"{what} output")
    (y * g).sum().backward()
    rows = emb.weight.meta.local_slice()[0]
    real = rows.stop - rows.start
    close(emb.weight.grad[:real], dw.grad[rows], f"{what} weight grad")
    assert not emb.weight.grad[real:].any(), f"{what}: padding rows got a gradient"


def dense_cross_entropy(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), reduction="none").view(target.shape)


def check_cross_entropy(r: Ranks):
    logits_full = randn(SEQ, BATCH, VOCAB, seed=31, scale=3.0)
    target = vocab_ids(r, 32).t().contiguous()  # [s, b]
    grad_loss = randn(SEQ, BATCH, seed=33).abs()
    dl = leaf(logits_full)
    dense = dense_cross_entropy(dl, target)
    (dense * grad_loss).sum().backward()

    width = padded_vocab_size(VOCAB, r.size) // r.size
    start = r.rank * width
    real = min(VOCAB, start + width) - start
    local = torch.full((SEQ, BATCH, width), 1.0e4)  # padding logits: huge, so they must be masked out
    local[..., :real] = logits_full[..., start:start + real]
    local = leaf(local)
    loss = vocab_parallel_cross_entropy(local, target, r.group, start, VOCAB)
    close(loss, dense, "cross entropy loss")
    (loss * grad_loss).sum().backward()
    close(local.grad[..., :real], dl.grad[..., start:start + real], "cross entropy logits grad")
    assert not local.grad[..., real:].any(), "cross entropy: padding logits got a gradient"


def check_output_layer(r: Ranks):
    """A column-parallel layer padded to the vocab, into the vocab-parallel loss (the untied output layer)."""
    w, x_full = randn(VOCAB, HIDDEN, seed=41, scale=0.1), randn(SEQ, BATCH, HIDDEN, seed=42)
    target = vocab_ids(r, 43).t().contiguous()
    dw, dx = leaf(w), leaf(x_full)
    dense = dense_cross_entropy(F.linear(dx, dw), target)
    dense.sum().backward()

    padded = padded_vocab_size(VOCAB, r.size)
    layer = ColumnParallelLinear(HIDDEN, VOCAB, tp_group=r.group, bias=False, padded_out=padded)
    load(layer, weight=w)
    x = leaf(x_full)
    loss = vocab_parallel_cross_entropy(layer(x), target, r.group, r.rank * padded // r.size, VOCAB)
    close(loss, dense, "output layer loss")
    loss.sum().backward()
    rows = layer.weight.meta.local_slice()[0]
    real = rows.stop - rows.start
    close(x.grad, dx.grad, "output layer input grad")
    close(layer.weight.grad[:real], dw.grad[rows], "output layer weight grad")
    assert not layer.weight.grad[real:].any(), "output layer: padding rows got a gradient"


def check_mapping(r: Ranks, name: str):
    """Forward and backward of one mapping against its dense meaning: every rank's input and upstream
    gradient is drawn by every rank, so the dense computation runs the whole tp group in one process."""
    n, k = r.size, r.rank
    shape = (SEQ, BATCH, HIDDEN)
    shard = (SEQ // n, BATCH, HIDDEN)
    last = (SEQ, BATCH, HIDDEN // n)
    if name == "copy_to_tp":  # replicated input feeding a different (partitioned) computation per rank
        x_full, grads = randn(*shape, seed=51), r.per_rank(*shape, seed=52)
        dx = leaf(x_full)
        sum((dx * g).sum() for g in grads).backward()
        x = leaf(x_full)
        y, g_local, expect_y, expect_dx = copy_to_tp(x, r.group), grads[k], x_full, dx.grad
    elif name == "reduce_from_tp":  # partial sums -> their sum, replicated
        xs, grad = r.per_rank(*shape, seed=53), randn(*shape, seed=54)
        dxs = [leaf(t) for t in xs]
        dense = sum(dxs)
        (dense * grad).sum().backward()
        x = leaf(xs[k])
        y, g_local, expect_y, expect_dx = reduce_from_tp(x, r.group), grad, dense, dxs[k].grad
    elif name == "gather_from_tp":  # last-dim slices -> the full tensor, replicated
        xs, grad = r.per_rank(*last, seed=57), randn(*shape, seed=58)
        dxs = [leaf(t) for t in xs]
        dense = torch.cat(dxs, dim=-1)
        (dense * grad).sum().backward()
        x = leaf(xs[k])
        y, g_local, expect_y, expect_dx = gather_from_tp(x, r.group), grad, dense, dxs[k].grad
    elif name == "scatter_to_sp":  # replicated input, each rank keeps its sequence shard
        x_full, grads = randn(*shape, seed=59), r.per_rank(*shard, seed=60)
        dx = leaf(x_full)
        sum((c * g).sum() for c, g in zip(dx.chunk(n, dim=0), grads)).backward()
        x = leaf(x_full)
        y, g_local, expect_y, expect_dx = scatter_to_sp(x, r.group), grads[k], r.seq_shard(x_full), dx.grad
    elif name in ("gather_from_sp", "gather_from_sp(to_model_parallel=False)"):
        # sequence shards -> the full sequence, feeding a partitioned computation (a different upstream
        # gradient per rank) or a replicated one (the same upstream gradient on every rank, counted once)
        to_mp = name == "gather_from_sp"
        xs = r.per_rank(*shard, seed=61)
        grads = r.per_rank(*shape, seed=62) if to_mp else [randn(*shape, seed=62)] * n
        dxs = [leaf(t) for t in xs]
        dense = torch.cat(dxs, dim=0)
        (sum((dense * g).sum() for g in grads) if to_mp else (dense * grads[0]).sum()).backward()
        x = leaf(xs[k])
        y, g_local, expect_y, expect_dx = gather_from_sp(x, r.group, to_mp), grads[k], dense, dxs[k].grad
    elif name == "reduce_scatter_to_sp":  # partial sums -> this rank's sequence shard of their sum
        xs, grads = r.per_rank(*shape, seed=63), r.per_rank(*shard, seed=64)
        dxs = [leaf(t) for t in xs]
        dense = sum(dxs)
        sum((c * g).sum() for c, g in zip(dense.chunk(n, dim=0), grads)).backward()
        x = leaf(xs[k])
        y, g_local, expect_y, expect_dx = reduce_scatter_to_sp(x, r.group), grads[k], r.seq_shard(dense), dxs[k].grad
    else:
        raise ValueError(name)
    before = x.detach().clone()
    close(y, expect_y, f"{name} output")
    (y * g_local).sum().backward()
    close(x.grad, expect_dx, f"{name} input grad")
    assert torch.equal(x.detach(), before), f"{name} modified its input"


MAPPINGS = ("copy_to_tp", "reduce_from_tp", "gather_from_tp", "scatter_to_sp", "gather_from_sp",
            "gather_from_sp(to_model_parallel=False)", "reduce_scatter_to_sp")


def all_checks(tp: int):
    assert dist.get_world_size() == tp
    r = Ranks(dist.new_group(list(range(tp))))
    done = []
    checks = [(f"column sp={sp}", check_column, (sp,)) for sp in (False, True)]
    checks += [(f"row sp={sp}", check_row, (sp,)) for sp in (False, True)]
    checks += [(f"embedding {red}", check_embedding, (red,))
               for red in ("all_reduce", "all_reduce+scatter_to_sp", "reduce_scatter")]
    checks += [("cross entropy", check_cross_entropy, ()), ("output layer", check_output_layer, ())]
    checks += [(name, check_mapping, (name,)) for name in MAPPINGS]
    for name, check, args in checks:
        check(r, *args)
        done.append(name)
    return done


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_layers_and_mappings_match_dense(tp):
    results = run_distributed(all_checks, tp, tp)
    assert all(done == results[0] for done in results) and len(results[0]) == 9 + len(MAPPINGS), results
