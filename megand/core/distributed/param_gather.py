"""ZeRO-3: gather each parameter bucket just before it is used and free it right after.

Forward: a pre-hook on every module that reads parameters gathers the module's buckets (and starts
gathering the next bucket of forward order, so it overlaps this one's compute); once every module using
a bucket has run forward, the bucket is freed (``reshard_after_forward``; otherwise it stays for the
backward). Backward: a hook on each module output gathers the module's buckets when backward reaches it
(and prefetches the next bucket of backward order); they are *held* until every gradient of the bucket
has arrived in this backward, then freed. A forward that runs while buckets are held is activation
recomputation inside backward: it gathers its buckets as held and prefetches nothing.

Freeing resizes the bucket's storage to 0: the parameters keep their shapes and autograd's saved
references, which see the values again once the bucket is gathered back before their backward.
"""

from __future__ import annotations

import itertools

import torch

from megand.core.distributed.forward_order import module_params
from megand.core.distributed.fp8_gather import BACKWARD, FORWARD
from megand.core.tensor_parallel.mappings import all_gather_flat


def _tensors(output):
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for t in output if isinstance(t, torch.Tensor)]
    return []


class ParamGatherer:
    """The ZeRO-3 life cycle of the engine's parameter buckets (see data_parallel.py's docstring)."""

    def __init__(self, engine, chunks, chunk_of):
        self.engine, self.buckets, self.bucket_of = engine, engine.buckets, engine.bucket_of
        self.reshard_after_forward = engine.reshard_after_forward
        self._users = {b.index: set() for b in self.buckets}  # modules whose forward reads the bucket
        self._module_buckets = {}
        self._prefetch_forward = {}  # module -> the bucket to gather while it runs
        self.hooks = []  # the module hooks registered here (the engine's close() removes them)
        for chunk in chunks:
            first_use, users = {}, []  # bucket -> position of its first user in forward; users in order
            for module in chunk.modules():
                indices = {self.bucket_of[p].index for p in module_params(module, borrowed=True) if p in self.bucket_of}
                indices = [i for i in engine.forward_order if i in indices]  # gathered in this order
                if not indices:
                    continue
                for i in indices:
                    first_use.setdefault(i, len(users))
                users.append(module)
                self._module_buckets[module] = indices
                for i in indices:
                    self._users[i].add(module)
                self.hooks.append(module.register_forward_pre_hook(self.before_forward))
                self.hooks.append(module.register_forward_hook(self.after_forward))
            # forward prefetches the bucket first read next after this module: not merely the next one in
            # forward order, which a later user of an earlier bucket (a norm between FP8 linears, whose
            # weights live in another buffer) would gather again after its forward was over
            for position, module in enumerate(users):
                later = [(t, i) for i, t in first_use.items() if t > position]
                if later:
                    self._prefetch_forward[module] = min(later, key=lambda ti: (ti[0], engine.forward_order.index(ti[1])))[1]
        # backward prefetches the bucket before a module's first one in forward order, of the same model
        # chunk (another chunk's backward runs for another micro-batch, not next)
        self._next_backward = {}
        order = engine.forward_order
        for a, b in itertools.pairwise(order):
            if chunk_of[self.buckets[a].params[0][0]] == chunk_of[self.buckets[b].params[0][0]]:
                self._next_backward[b] = a
        self._gathers = {}  # bucket index -> all-gathers in flight
        self._done = {b.index: set() for b in self.buckets}  # users whose forward ran since the gather
        self._held = set()  # buckets gathered for backward: freed only when their gradients have arrived
        self._awaiting = {}  # held bucket -> parameters whose gradient has not arrived in this backward
        self.max_gathered = 0  # the most buckets gathered at once (reported by tests and benchmarks)
        self._n_gathered = 0

    def _gathered(self, i) -> bool:
        """Whether bucket ``i`` holds anything gathered (high precision, or FP8 operands)."""
        bucket = self.buckets[i]
        return bucket.gathered or (bucket.fp8 is not None and bool(bucket.fp8.formats))

    def gathered_buckets(self) -> list[int]:
        """The buckets holding anything gathered now."""
        return [b.index for b in self.buckets if self._gathered(b.index)]

    def gather(self, i, wait=True, phase=None):
        """Gather bucket ``i`` for ``phase`` (forward or backward: FP8 operands where the bucket's recipe
        gathers FP8 for it, else the high-precision parameters, which serve any phase; None: nothing
        new), then wait for all of its gathers in flight (``wait``)."""
        bucket = self.buckets[i]
        fp8 = bucket.fp8 if bucket.fp8 is not None and phase is not None and bucket.fp8.gathers(phase) else None
        needed = phase is not None and not bucket.gathered and not (fp8 is not None and fp8.serves(phase))
        if needed:
            if not self._gathered(i):
                self._done[i] = set()
                self._n_gathered += 1
                self.max_gathered = max(self.max_gathered, self._n_gathered)
            reduce = bucket.buffer.reduce  # the buffer's shard group (experts: their expert-dp group)
            if reduce.size > 1:
                self.engine.record("all_gather", i, phase)
            if fp8 is not None:
                self._gathers.setdefault(i, []).append(fp8.start(phase, self.engine))
            else:
                bucket.alloc_full()
                if reduce.size == 1:
                    bucket.full.copy_(bucket.data_shard)
                else:
                    self.engine.count("all_gather", bucket.full, reduce.size)
                    work = all_gather_flat(bucket.full, bucket.data_shard, group=reduce.group, async_op=not wait)
                    self._gathers.setdefault(i, []).append(work)
        if wait:
            for work in self._gathers.pop(i, []):
                if work is not None:
                    work.wait()

    def release(self, i):
        gathered = self._gathered(i)
        for work in self._gathers.pop(i, []):
            if work is not None:
                work.wait()
        bucket = self.buckets[i]
        if bucket.gathered:
            bucket.free_full()
        if bucket.fp8 is not None:
            bucket.fp8.clear()
        if gathered:
            self._n_gathered -= 1
        self._held.discard(i)
        self._awaiting.pop(i, None)

    def release_all(self):
        for bucket in self.buckets:
            if self._gathered(bucket.index):
                self.release(bucket.index)

    def release_held(self):
        """Free every bucket held for a backward (the input-gradient pass of a split backward is over)."""
        for i in list(self._held):
            self.release(i)

    def before_forward(self, module, args):
        if self._held:  # inside a backward: activation recomputation, whose backward comes next
            self._hold(self._module_buckets[module], forward=True)
            return
        # issue in forward order: this module's buckets, then the prefetch of the next one (which
        # overlaps this module's compute); a communicator runs its collectives in the order issued
        indices = self._module_buckets[module]
        for i in indices:
            self.gather(i, wait=False, phase=FORWARD)
        nxt = self._prefetch_forward.get(module)
        if nxt is not None:
            self.gather(nxt, wait=False, phase=FORWARD)
        for i in indices:
            self.gather(i)

    def after_forward(self, module, args, output):
        backward_follows = torch.is_grad_enabled()
        for i in self._module_buckets[module]:
            self._done[i].add(module)
            if (i not in self._held and self._done[i] >= self._users[i]
                    and (self.reshard_after_forward or not backward_follows)):
                self.release(i)
        if backward_follows:
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda grad, m=module: self.before_backward(m))

    def _hold(self, indices, prefetch=None, forward=False):
        """Gather ``indices`` for a backward (and for the forward recomputed before it: ``forward``): kept
        until all their gradients of this backward arrived. ``prefetch``: a bucket whose gather is issued
        after theirs, not waited for."""
        phases = (BACKWARD, FORWARD) if forward else (BACKWARD,)  # high precision for backward serves both
        for i in indices:
            for phase in phases:
                self.gather(i, wait=False, phase=phase)
        if prefetch is not None and prefetch not in self._held:
            self.gather(prefetch, wait=False, phase=BACKWARD)
        for i in indices:
            self.gather(i)
            if i not in self._held:
                self._held.add(i)
                self._awaiting[i] = {p for p, _ in self.buckets[i].params}

    def before_backward(self, module):
        indices = self._module_buckets[module][::-1]  # backward reads them in reverse forward order
        self._hold(indices, prefetch=self._next_backward.get(indices[-1]))

    def after_grad(self, p, bucket):
        awaiting = self._awaiting.get(bucket.index)
        if awaiting is not None:
            awaiting.discard(p)
            if not awaiting:
                self.release(bucket.index)
