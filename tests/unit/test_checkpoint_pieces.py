"""A distributed-optimizer shard (a flat range of a tp-sharded, vocab-padded parameter) as rectangular
pieces of the full tensor: exact cover, views of the shard, padding left out."""

import itertools

import pytest
import torch

from megand.core.checkpointing.pieces import flat_range_boxes
from megand.core.checkpointing.sharded import flat_pieces
from megand.core.sharding import ParamMeta, tag


@pytest.mark.parametrize("shape", [(7,), (3, 5), (4, 3, 5), (2, 3, 2, 3)])
def test_flat_range_boxes_cover_the_range_exactly(shape):
    n = torch.Size(shape).numel()
    full = torch.arange(n).view(shape)
    for lo, hi in itertools.combinations(range(n + 1), 2):
        boxes = flat_range_boxes(lo, hi, shape)
        assert len(boxes) <= 2 * len(shape) - 1
        seen = []
        for offsets, sizes, first in boxes:
            block = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            # the box is the contiguous run of the flat range starting at ``first``
            assert torch.equal(block.reshape(-1), torch.arange(first, first + block.numel())), (lo, hi, offsets, sizes)
            seen += block.reshape(-1).tolist()
        assert sorted(seen) == list(range(lo, hi)), (lo, hi, boxes)


def _shards(full_shape, split_dim, tp, padded_rows):
    """Every tp rank's local parameter (padded to ``padded_rows`` along ``split_dim``), holding its slice."""
    full = torch.arange(torch.Size(full_shape).numel(), dtype=torch.float32).view(full_shape) + 1
    for r in range(tp):
        meta = ParamMeta(tuple(full_shape), split_dim=split_dim, tp_rank=r, tp_size=tp)
        shape = list(full_shape)
        if split_dim is not None:
            shape[split_dim] = padded_rows
        local = torch.zeros(shape)  # padding stays 0
        piece = full[meta.local_slice()]
        local[tuple(slice(0, k) for k in piece.shape)] = piece
        yield full, tag(torch.nn.Parameter(local), meta)


@pytest.mark.parametrize("full_shape, split_dim, tp, padded_rows", [
    ((10, 6), 0, 4, 3),  # vocab 10 over tp 4: 3, 3, 3, 1 rows + padding
    ((6, 8), 1, 2, 4),  # column split
    ((5, 4), None, 2, None),  # replicated
    ((9,), 0, 2, 5),
])
def test_shards_of_every_rank_reassemble_the_full_tensor(full_shape, split_dim, tp, padded_rows):
    dp = 3
    for full, param in _shards(full_shape, split_dim, tp, padded_rows):
        flat = param.detach().reshape(-1)
        n = flat.numel()
        cover = torch.zeros(full_shape)
        for r in range(dp):  # dp ranks own consecutive flat ranges, as in a bucket
            lo, hi = n * r // dp, n * (r + 1) // dp
            shard = flat[lo:hi].clone()
            for p in flat_pieces("k", param, lo, hi, shard):
                assert p.tensor.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()  # a view, no copy
                assert p.full_shape == tuple(full_shape)
                box = tuple(slice(o, o + s) for o, s in zip(p.offsets, p.tensor.shape))
                assert torch.equal(p.tensor, full[box])  # padding rows are not in any piece
                cover[box] += 1
        mine = torch.zeros(full_shape)
        mine[param.meta.local_slice()] = 1
        assert torch.equal(cover, mine)  # this tp rank's slice, every element exactly once


def test_a_shard_of_padding_rows_only_is_no_piece():
    """tp=4 with a vocab of 251 padded to 512: tp ranks 2 and 3 hold only padding rows of the embedding. Their
    empty shard was staged as a zero-size view, which failed ("self.stride(-1) must be 1 to view Byte as
    Float") when a tp=4 run saved a checkpoint."""
    from types import SimpleNamespace

    from megand.core.checkpointing.sharded import exact_storage, weight_pieces
    from megand.core.sharding import ParamMeta

    empty = torch.zeros(128, 64).narrow(0, 0, 0)
    assert exact_storage(empty).shape == (0, 64)
    table = torch.nn.Parameter(torch.zeros(128, 64))
    table.meta = ParamMeta((251, 64), 0, tp_rank=3, tp_size=4, padded_size=512)
    kept = torch.nn.Parameter(torch.zeros(128, 64))
    kept.meta = ParamMeta((251, 64), 0, tp_rank=1, tp_size=4, padded_size=512)
    pieces = weight_pieces([("table", table), ("kept", kept)], SimpleNamespace(shard_params=False), lambda n, p: n)
    assert [(p.key, p.offsets, tuple(p.tensor.shape)) for p in pieces] == [("kept", (128, 0), (123, 64))]
