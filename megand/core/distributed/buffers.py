"""Contiguous parameter and gradient buffers, split into buckets (Megatron's ParamAndGradBuffer).

For each parameter dtype there is one flat parameter buffer (that dtype) and one flat fp32 gradient
buffer with the same layout; every parameter's ``.data`` becomes a view into the first and its
``.main_grad`` a view into the second. Parameters are laid out in reverse registration order (roughly
the order backward produces their gradients), cut into buckets of about ``bucket_size`` elements at
parameter boundaries. With the distributed optimizer each bucket is padded to a multiple of the
dp x cp size and data-parallel rank ``r`` owns the ``r``-th contiguous slice of every bucket.

Which bucket a parameter goes to is a pure function of sizes (:func:`bucket_layout`), so every
replica, and every tensor-parallel peer, lays its buffers out identically.

Sharded gradients (ZeRO-2) keep only the rank's slices of the gradient buffer, packed one bucket
after the other (``grad_data`` is then ``1/shards`` of the layout); a bucket's full gradient exists only
while it is being accumulated and reduce-scattered (``Bucket.scratch``, behind ``Bucket.grads``). Sharded parameters
(ZeRO-3) do the same with the parameter buffer: ``param_data`` packs the rank's slices and every bucket
has its own full-size storage (``Bucket.full``) that the parameters view; the data-parallel engine fills
it by all-gather before the bucket's modules run and frees it afterwards (its storage resized to 0: the
parameters keep their shapes, so autograd's saved references stay valid once it is gathered again).
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
    packed: int = 0  # where this bucket's slice starts in a packed (sharded) buffer
    full: torch.Tensor | None = None  # sharded params: the bucket's own full-size parameter storage
    scratch: torch.Tensor | None = None  # sharded grads: the full gradient while it is accumulated
    fp8: object = None  # ZeRO-3 in FP8: the bucket's BucketFp8Gather (its parameters are FP8 layers' weights)

    def _packed(self, data, lo, hi, sharded):
        """Buffer offsets ``[lo, hi)`` (inside this rank's slice) of ``data``, packed or not."""
        if not sharded:
            return data[lo: hi]
        return data[self.packed + lo - self.shard_start: self.packed + hi - self.shard_start]

    @property
    def grads(self) -> torch.Tensor:
        """The full gradient of the bucket (sharded gradients: the scratch accumulator, allocated here)."""
        if self.buffer.shard_grads:
            if self.scratch is None:
                self.scratch = torch.zeros(self.numel, dtype=torch.float32, device=self.buffer.grad_data.device)
            return self.scratch
        return self.buffer.grad_data[self.start: self.end]

    @property
    def grad_shard(self) -> torch.Tensor:
        return self.grad_piece(self.shard_start, self.shard_end)

    def grad_piece(self, lo: int, hi: int) -> torch.Tensor:
        return self._packed(self.buffer.grad_data, lo, hi, self.buffer.shard_grads)

    @property
    def data(self) -> torch.Tensor:
        """The full parameters of the bucket (sharded parameters: only valid while gathered)."""
        return self.full if self.buffer.shard_params else self.buffer.param_data[self.start: self.end]

    @property
    def data_shard(self) -> torch.Tensor:
        return self.param_piece(self.shard_start, self.shard_end)

    def param_piece(self, lo: int, hi: int) -> torch.Tensor:
        return self._packed(self.buffer.param_data, lo, hi, self.buffer.shard_params)

    @property
    def gathered(self) -> bool:
        return self.full is None or self.full.untyped_storage().size() > 0

    def alloc_full(self) -> None:
        self.full.untyped_storage().resize_(self.numel * self.full.element_size())

    def free_full(self) -> None:
        self.full.untyped_storage().resize_(0)

    @property
    def numel(self) -> int:
        return self.end - self.start


def bucket_layout(numels, bucket_size: int, pad_to: int = 1, own_bucket=(), starts=(), align: int = 1):
    """Offsets and bucket boundaries for parameters of ``numels`` (in buffer order).

    Returns ``(offsets, buckets)`` with ``buckets`` a list of ``(start, end, [param indices])``; each
    bucket's length is a multiple of ``pad_to``. Indices in ``own_bucket`` get a bucket to themselves
    (the tied embedding copies, so both pipeline stages shard them identically); indices in ``starts``
    open a new bucket (model chunk boundaries, so a bucket's parameters are used by one chunk). Every
    parameter starts at a multiple of ``align`` elements from its bucket's start (``pad_to`` should then
    be a multiple of it).
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
        if i in own_bucket or i in starts:
            cursor = close(cursor)
        cursor = start + -(-(cursor - start) // align) * align
        offsets.append(cursor)
        members.append(i)
        cursor += n
        if i in own_bucket or cursor - start >= bucket_size:
            cursor = close(cursor)
    close(cursor)
    return offsets, buckets


# what the modules told a parameter about itself, carried over to the parameter that replaces it: its
# sharding tag (megand/core/sharding.py) and the policy of its GEMMs (megand/core/tensor_parallel/gemm.py)
CARRIED = ("meta", "gemm_policy")


class ParamAndGradBuffer:
    """The flat buffers of all parameters of one dtype; owns the memory the parameters view.

    A parameter on the meta device (a model built without allocating) is replaced by a new parameter
    that views the buffer (zeros; nothing copied), with the same attributes (sharding tag, GEMM policy): ``replaced`` maps
    ``id(old)`` to it, for the owner to put into its modules; initialise it afterwards (``init_parameters``;
    under ZeRO-3 the parameters view freed storage: initialise the packed slices of :meth:`shard_ranges`
    with ``init_flat_range``, so the full parameters are never allocated).
    """

    def __init__(self, params, dtype, bucket_size: int, shard_rank: int, shard_count: int, device,
                 shard_grads: bool = False, shard_params: bool = False, starts=(), align: int = 1):
        self.dtype, self.params = dtype, list(params)
        self.shard_grads, self.shard_params = shard_grads, shard_params
        own = {i for i, p in enumerate(self.params) if getattr(p.meta, "embedding_group_grad", False)} if shard_count > 1 else ()
        offsets, layout = bucket_layout([p.numel() for p in self.params], bucket_size, shard_count * align, own,
                                        starts, align)
        self.numel = layout[-1][1] if layout else 0
        packed = self.numel // shard_count
        self.param_data = torch.zeros(packed if shard_params else self.numel, dtype=dtype, device=device)
        self.grad_data = torch.zeros(packed if shard_grads else self.numel, dtype=torch.float32, device=device)
        self.buckets = []
        for k, (start, end, members) in enumerate(layout):
            shard = (end - start) // shard_count
            self.buckets.append(Bucket(k, start, end, [(self.params[i], offsets[i]) for i in members],
                                       start + shard_rank * shard, start + (shard_rank + 1) * shard, self,
                                       packed=start // shard_count))
        self.offset, self.replaced = {}, {}
        index = {id(p): i for i, p in enumerate(self.params)}
        with torch.no_grad():
            for bucket in self.buckets:
                # ZeRO-3, one bucket at a time: full storage for the parameters to view, keep the rank's
                # slice, free the rest (built on meta: nothing to copy, the storage is never written)
                built = any(not p.is_meta for p, _ in bucket.params)
                if shard_params:
                    bucket.full = (torch.zeros if built else torch.empty)(bucket.numel, dtype=dtype, device=device)
                for j, (p, off) in enumerate(bucket.params):
                    view = bucket.data[off - bucket.start: off - bucket.start + p.numel()].view(p.shape)
                    if p.is_meta:
                        # ``.data`` assigned, not passed: a parameter made from the view would share the
                        # buffer's version counter, so every later write into the buffer (another
                        # parameter's slice, a ZeRO-3 gather) would look to autograd like a change of
                        # the values it saved for backward
                        new = torch.nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=p.requires_grad)
                        new.data = view
                        for name in CARRIED:
                            if hasattr(p, name):
                                setattr(new, name, getattr(p, name))
                        self.replaced[id(p)] = self.params[index[id(p)]] = new
                        bucket.params[j] = (new, off)
                        p = new
                    else:
                        view.copy_(p.data)
                        p.data = view
                    p.main_grad = None if shard_grads else self.grad_data[off: off + p.numel()].view(p.shape)
                    self.offset[p] = off
                if shard_params:
                    if built:
                        bucket.data_shard.copy_(bucket.full[bucket.shard_start - bucket.start:
                                                            bucket.shard_end - bucket.start])
                    bucket.free_full()

    def shard_ranges(self):
        """This rank's share of every parameter as ``(param, lo, hi, data)``: elements ``[lo, hi)`` of
        the flattened local parameter and the parameter-buffer view that holds them (packed under ZeRO-3,
        so valid whether or not the bucket is gathered)."""
        for p, bucket, lo, hi in self.pieces():
            off = self.offset[p]
            yield p, lo - off, hi - off, bucket.param_piece(lo, hi)

    def pieces(self):
        """This rank's share of every parameter: ``(param, bucket, lo, hi)`` with ``[lo, hi)`` buffer
        offsets inside the rank's slice of the bucket (the whole parameter when not sharded)."""
        for bucket in self.buckets:
            for p, off in bucket.params:
                lo, hi = max(off, bucket.shard_start), min(off + p.numel(), bucket.shard_end)
                if lo < hi:
                    yield p, bucket, lo, hi
