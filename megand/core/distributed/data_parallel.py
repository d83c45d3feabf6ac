"""The data-parallel engine: fp32 main gradients in bucketed buffers, reduced over dp x cp.

Every parameter's gradient is accumulated, micro-batch after micro-batch, into ``param.main_grad``,
an fp32 view into its dtype's gradient buffer (a post-accumulate-grad hook adds ``param.grad`` and
frees it). Once a step's gradients are final, each bucket is summed over the dp x cp group: an
all-reduce, or with the distributed optimizer a reduce-scatter that leaves each rank the sum of its own
slice. With the distributed optimizer the updated parameters are then all-gathered back into every
replica's parameter buffer.

Protocol for schedules (what a forward/backward schedule must do)
-----------------------------------------------------------------
A schedule receives ``grad_sync``: this engine, or ``None``. It runs the LAST backward of the step
*for each model chunk* inside ``grad_sync.last_backward()`` (use :func:`last_backward`, which accepts
``None``):

- no pipelining: the backward of the last micro-batch;
- 1F1B: the last backward of the cool-down phase;
- interleaved 1F1B: for every chunk, the backward of its last micro-batch (chunks finish at
  different times; each chunk's buckets start reducing as soon as that chunk is done).

A gradient that arrives inside ``last_backward()`` is final: with ``optim.overlap_grad_reduce`` each
bucket's reduction is launched (asynchronously) the moment its last parameter's gradient is final,
while the rest of backward runs. After the schedule, the trainer calls :meth:`finish_grad_sync`, which
launches whatever has not started and waits for everything. A schedule that ignores ``grad_sync`` is
still correct (everything is reduced in ``finish_grad_sync``, with no overlap); one that runs more than
one backward per chunk inside ``last_backward()`` gets an error, not a wrong sum.

Per step, the trainer calls: ``zero_grad()`` -> schedule(..., grad_sync=engine) -> ``finish_grad_sync()``
(dp x cp reduction, then the layout reductions of grads.py) -> optimizer step (which ends with
``start_param_sync()``).

With ``optim.overlap_param_gather`` the all-gathers of updated parameters run while the next forward
starts: a forward pre-hook on every module waits only for the buckets holding that module's
parameters. Anything else that reads parameters outside a forward (checkpoint save, export) must call
:meth:`finish_param_sync` first (the checkpointer does).
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from megand.core.distributed.buffers import ParamAndGradBuffer
from megand.core.distributed.config import DataParallelConfig
from megand.core.distributed.grads import all_reduce_layout_grads
from megand.core.tensor_parallel.mappings import all_gather_flat, reduce_scatter_flat


def last_backward(grad_sync):
    """``grad_sync.last_backward()``, or nothing when the schedule was given no engine."""
    return grad_sync.last_backward() if grad_sync is not None else contextlib.nullcontext()


class DataParallel:
    """Gradient buffers and their reduction for this rank's model chunks: initialised chunks (their
    parameters are copied into the buffers) or chunks built on the meta device (their parameters are
    replaced by views of the buffers, to be initialised in place afterwards)."""

    def __init__(self, chunks, topo, config: DataParallelConfig):
        self.topo, self.config = topo, config
        self.group, self.size = topo.dp_cp_group, topo.dp_cp_size
        self.distributed = config.distributed
        self.overlap_grad_reduce = config.overlap_grad_reduce
        self.overlap_param_gather = config.overlap_param_gather and self.distributed
        params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
        by_dtype = {}
        for p in reversed(params):  # backward produces gradients in roughly reverse order
            by_dtype.setdefault(p.dtype, []).append(p)
        shards = (topo.dp_cp_rank, self.size) if self.distributed else (0, 1)
        self.buffers = [ParamAndGradBuffer(ps, dtype, config.bucket_size, *shards, topo.device)
                        for dtype, ps in by_dtype.items()]
        replaced = {k: v for buf in self.buffers for k, v in buf.replaced.items()}
        if replaced:  # parameters built on the meta device now live in the buffers: put them in the modules
            for chunk in chunks:
                for module in chunk.modules():
                    for name, p in list(module._parameters.items()):
                        if p is not None and id(p) in replaced:
                            module._parameters[name] = replaced[id(p)]
            params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
        self.buckets = [b for buf in self.buffers for b in buf.buckets]
        for i, bucket in enumerate(self.buckets):
            bucket.index = i
        self.bucket_of = {p: b for b in self.buckets for p, _ in b.params}
        self.params = params
        self._final = False  # inside last_backward()
        self._pending = {}  # bucket index -> parameters whose final gradient has not arrived
        self._grad_handles, self._param_handles = {}, {}
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)
        if self.overlap_param_gather:
            for chunk in chunks:
                for module in chunk.modules():
                    own = [p for p in module.parameters(recurse=False) if p in self.bucket_of]
                    if own:
                        indices = sorted({self.bucket_of[p].index for p in own})
                        module.register_forward_pre_hook(lambda m, args, ix=indices: self._wait_params(ix))
        self.zero_grad()

    # -- gradients ---------------------------------------------------------------------------------
    def zero_grad(self):
        """Start a step: empty the gradient buffers; no bucket has its final gradients yet."""
        assert not self._grad_handles, "zero_grad() while gradient reductions are in flight"
        for buf in self.buffers:
            buf.grad_data.zero_()
        for p in self.params:
            p.grad = None
        self._pending = {b.index: {p for p, _ in b.params} for b in self.buckets}
        self._launched = set()
        self._synced = False

    @contextlib.contextmanager
    def last_backward(self):
        """Backward passes run inside deliver final gradients (see the module docstring)."""
        self._final = True
        try:
            yield
        finally:
            self._final = False

    def _on_grad(self, p):
        bucket = self.bucket_of[p]
        if bucket.index in self._launched:
            raise RuntimeError("a gradient arrived after its bucket was reduced: the schedule ran more than one "
                               "backward per chunk inside last_backward()")
        p.main_grad.add_(p.grad)
        p.grad = None
        if self._final:
            pending = self._pending[bucket.index]
            pending.discard(p)
            if not pending and self.overlap_grad_reduce:
                self._reduce(bucket)

    def _reduce(self, bucket):
        """Launch the bucket's sum over dp x cp (asynchronous; waited for in finish_grad_sync)."""
        self._launched.add(bucket.index)
        if self.size == 1:
            return
        if self.distributed:
            work = reduce_scatter_flat(bucket.grad_shard, bucket.grads, group=self.group, async_op=True)
        else:
            work = dist.all_reduce(bucket.grads, group=self.group, async_op=True)
        self._grad_handles[bucket.index] = work

    def finish_grad_sync(self):
        """Launch the reductions not yet started, wait for all, then run the layout's reductions
        (grads.py: sequence-parallel tp sum, tied-embedding sum). Afterwards every ``main_grad`` (with
        the distributed optimizer: this rank's slice of it) is the gradient of the global loss.
        Idempotent within a step."""
        if self._synced:
            return
        for bucket in self.buckets:
            if bucket.index not in self._launched:
                self._reduce(bucket)
        for work in self._grad_handles.values():
            work.wait()
        self._grad_handles.clear()
        all_reduce_layout_grads(self.params, self.topo)
        self._synced = True

    # -- parameters (distributed optimizer) ---------------------------------------------------------
    def start_param_sync(self):
        """All-gather every bucket's updated slices into the parameter buffers (asynchronously when
        ``overlap_param_gather``: the next forward waits per module)."""
        if not self.distributed or self.size == 1:
            return
        for bucket in self.buckets:
            work = all_gather_flat(bucket.data, bucket.data_shard, group=self.group, async_op=self.overlap_param_gather)
            if self.overlap_param_gather:
                self._param_handles[bucket.index] = work

    def _wait_params(self, indices):
        for i in indices:
            work = self._param_handles.pop(i, None)
            if work is not None:
                work.wait()

    def finish_param_sync(self):
        """Wait for every parameter all-gather still in flight."""
        self._wait_params(list(self._param_handles))
