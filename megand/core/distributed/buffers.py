"""Contiguous parameter and gradient buffers, split into buckets (Megatron's ParamAndGradBuffer).

For each parameter dtype there is one flat parameter buffer (that dtype) and one flat fp32 gradient
buffer with the same layout; every parameter's ``.data`` becomes a view into the first and its
``.main_grad`` a view into the second. Parameters are laid out in reverse registration order (roughly
the order backward produces their gradients), cut into buckets of about ``bucket_size`` elements at
parameter boundaries. With the distributed optimizer each bucket is padded to a multiple of the
dp x cp size and data-parallel rank ``r`` owns the ``r``-th contiguous slice of every bucket.

Which bucket a parameter goes to is a pure function of sizes (:func:`bucket_layout`), so every
replica, and every tensor-parallel peer, lays its buffers out identically.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Bucket:
    index: int
    start: int  # [start, end) in the buffer, padding included
    end: int
    params: list = field(default_factory=list)  # (param, offset in buffer)
    shard_start: int = 0  # this rank's slice [shard_start, shard_end) in the buffer
    shard_end: int = 0
    buffer: "ParamAndGradBuffer | None" = None

    @property
    def grads(self) -> torch.Tensor:
        return self.buffer.grad_data[self.start: self.end]

    @property
    def grad_shard(self) -> torch.Tensor:
        return self.buffer.grad_data[self.shard_start: self.shard_end]

    @property
    def data(self) -> torch.Tensor:
        return self.buffer.param_data[self.start: self.end]

    @property
    def data_shard(self) -> torch.Tensor:
        return self.buffer.param_data[self.shard_start: self.shard_end]

    @property
    def numel(self) -> int:
        return self.end - self.start


def bucket_layout(numels, bucket_size: int, pad_to: int = 1, own_bucket=()):
    """Offsets and bucket boundaries for parameters of ``numels`` (in buffer order).

    Returns ``(offsets, buckets)`` with ``buckets`` a list of ``(start, end, [param indices])``; each
    bucket's length is a multiple of ``pad_to``. Indices in ``own_bucket`` get a bucket to themselves
    (the tied embedding copies, so both pipeline stages shard them identically).
    """
    offsets, buckets = [], []
    start, members = 0, []

    def close(end):
        nonlocal start, members
        if members:
            end = -(-end // pad_to) * pad_to
            buckets.append((start, end, members))
            start, members = end, []
        return start

    cursor = 0
    for i, n in enumerate(numels):
        if i in own_bucket:
            cursor = close(cursor)
        offsets.append(cursor)
        members.append(i)
        cursor += n
        if i in own_bucket or cursor - start >= bucket_size:
            cursor = close(cursor)
    close(cursor)
    return offsets, buckets


class ParamAndGradBuffer:
    """The flat buffers of all parameters of one dtype; owns the memory the parameters view.

    A parameter on the meta device (a model built without allocating) is replaced by a new parameter
    that views the buffer (zeros; nothing copied), with the same sharding tag: ``replaced`` maps
    ``id(old)`` to it, for the owner to put into its modules; initialise it afterwards (``init_parameters``).
    """

    def __init__(self, params, dtype, bucket_size: int, shard_rank: int, shard_count: int, device):
        self.dtype, self.params = dtype, list(params)
        own = {i for i, p in enumerate(self.params) if getattr(p.meta, "embedding_group_grad", False)} if shard_count > 1 else ()
        offsets, layout = bucket_layout([p.numel() for p in self.params], bucket_size, shard_count, own)
        self.numel = layout[-1][1] if layout else 0
        self.param_data = torch.zeros(self.numel, dtype=dtype, device=device)
        self.grad_data = torch.zeros(self.numel, dtype=torch.float32, device=device)
        self.offset, self.replaced = {}, {}
        with torch.no_grad():
            for i, (p, off) in enumerate(zip(self.params, offsets)):
                view = self.param_data[off: off + p.numel()].view(p.shape)
                if p.is_meta:
                    new = torch.nn.Parameter(view, requires_grad=p.requires_grad)
                    if hasattr(p, "meta"):
                        new.meta = p.meta
                    self.replaced[id(p)] = self.params[i] = p = new
                else:
                    view.copy_(p.data)
                    p.data = view
                p.main_grad = self.grad_data[off: off + p.numel()].view(p.shape)
                self.offset[p] = off
        self.buckets = []
        for k, (start, end, members) in enumerate(layout):
            shard = (end - start) // shard_count
            self.buckets.append(Bucket(k, start, end, [(self.params[i], offsets[i]) for i in members],
                                       start + shard_rank * shard, start + (shard_rank + 1) * shard, self))

    def pieces(self):
        """This rank's share of every parameter: ``(param, bucket, lo, hi)`` with ``[lo, hi)`` buffer
        offsets inside the rank's slice of the bucket (the whole parameter when not sharded)."""
        for bucket in self.buckets:
            for p, off in bucket.params:
                lo, hi = max(off, bucket.shard_start), min(off + p.numel(), bucket.shard_end)
                if lo < hi:
                    yield p, bucket, lo, hi
