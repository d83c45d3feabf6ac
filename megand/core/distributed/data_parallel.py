"""The data-parallel engine: fp32 main gradients in bucketed buffers, reduced over dp x cp.

Every parameter's gradient is accumulated, micro-batch after micro-batch, into ``param.main_grad``,
an fp32 view into its dtype's gradient buffer: the parallel linear layers add their weight gradient
there themselves, at fp32 (``param.accumulate_grad``); for the other parameters a post-accumulate-grad
hook adds autograd's ``param.grad`` and frees it. Once a step's gradients are final, each bucket is
summed over the dp x cp group: an all-reduce, or with the distributed optimizer a reduce-scatter that
leaves each rank the sum of its own slice. With the distributed optimizer the updated parameters are then all-gathered back into every
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

A schedule that splits each backward into its input-gradient pass and a later weight-gradient pass
(zero bubble) cannot name one final backward: a parameter's last gradient arrives in the last input-
gradient pass (norms, embeddings, autograd's gradients) or in a weight-gradient pass run afterwards, in
whatever order the schedule puts them. It calls :meth:`expect_contributions` with the number of
micro-batches instead: every parameter receives one gradient per micro-batch, and the one that brings
its count to that number is final. After each input-gradient pass it calls :meth:`input_grads_done`.

A gradient that arrives inside ``last_backward()`` (or completes its parameter's count) is final: with ``optim.overlap_grad_reduce`` each
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
parameters. They are issued in the order the forward reads the buckets (forward_order.py), since a
communicator runs its collectives in the order issued: the first module waits for its own bucket only.
Anything else that reads parameters outside a forward (checkpoint save, export) must call
:meth:`finish_param_sync` first (the checkpointer does). Under ZeRO-3 parameters are only readable
inside their module's forward and backward: outside, read this rank's slices (:meth:`param_shards`).

Sharding levels (``DataParallelConfig.sharding``), over the shard group (dp x cp, or ``dp_shard`` of it)
------------------------------------------------------------------------------------------------------
- ``optim`` (ZeRO-1): the optimizer owns one slice of every bucket; reduce-scatter, then all-gather of
  the updated parameters.
- ``optim_grads`` (ZeRO-2): the fp32 gradient buffer holds only the rank's slices. Each backward adds
  its gradients into a scratch copy of the bucket; once every parameter of the bucket has contributed,
  the scratch is reduce-scattered into the rank's slice and freed (every micro-batch: that is the price
  of not keeping the full gradient).
- ``optim_grads_params`` (ZeRO-3): the parameter buffer holds only the rank's slices too. A forward
  pre-hook all-gathers the buckets of a module before it runs (and starts gathering the next bucket);
  when every module using a bucket has run forward the bucket is freed again (``reshard_after_forward``;
  otherwise it stays until its backward). A hook on each module's output gathers the module's buckets
  again when backward reaches it (and prefetches the next bucket of backward); once all of a bucket's
  gradients have arrived it is freed. Activation recomputation re-runs forwards inside backward (while
  some bucket is held for backward): those gather their buckets as held for the backward that follows,
  never prefetch the buckets of layers whose backward is over, and free nothing.
- hybrid (HSDP, ``dp_shard`` smaller than dp x cp): all of the above inside the shard group; the
  reduced gradient slices are then summed over the replicas (the same slice of the other shard groups).

A module whose forward reads parameters of another module (the output layer tied to the word embedding
on one stage) lists them in a ``borrowed_parameters()`` method, so ZeRO-3 gathers them for it too.

Uneven batch shares (``parallel.dp_microbatches``, megand/core/batch_shares.py) with a shard group that
spans replicas of different shares (pp=1): a replica with fewer micro-batches than the largest share still
takes part in every per-micro-batch collective of its shard groups, in the same order, without computing.
The trainer runs its real micro-batches inside :meth:`lockstep`, which records the per-micro-batch
collectives this engine issues (ZeRO-3's parameter all-gathers, ZeRO-2/3's gradient reduce-scatters), and
then joins the missing micro-batches with :meth:`join_microbatch` ("phantom" micro-batches): the same
collectives through the same code, one bucket at a time, its gathers dropped and its reduce-scatters fed
zeros (their output, the other replicas' sum for this rank's slice, is kept: the token-weighted sum stays
exact). It keeps ZeRO-2/3's memory under uneven shares, not their speed: every micro-batch is a meeting
of the whole shard group (megand/tools/planner/shares.py says what that costs).

Routed experts (parameters tagged ``meta.expert``) under expert parallelism live in buffers of their own,
reduced (and, at every sharding level, sharded) over the expert-data-parallel group instead: the ranks
holding the same experts. Each buffer carries its :class:`ReduceGroup`.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megand.core.distributed.buffers import ParamAndGradBuffer
from megand.core.distributed.config import DataParallelConfig
from megand.core.distributed.forward_order import forward_order
from megand.core.distributed.fp8_gather import BucketFp8Gather, Fp8Weight
from megand.core.distributed.grads import all_reduce_layout_grads
from megand.core.distributed.param_gather import ParamGatherer
from megand.core.tensor_parallel.fp8 import Fp8Policy
from megand.core.tensor_parallel.fp8_recipes import fp8_recipe
from megand.core.tensor_parallel.mappings import all_gather_flat, reduce_scatter_flat
from megand.core.tensor_parallel.wgrad import DeferredWeightGrads, WeightGradSink, add_product


@dataclass(frozen=True)
class ReduceGroup:
    """Where one buffer's gradients are summed and its slices owned: ``size`` ranks of ``group`` (this
    one at ``rank``), then under hybrid sharding summed again over ``replicas`` ranks of ``replica_group``."""
    group: object
    size: int
    rank: int
    replica_group: object = None
    replicas: int = 1
    replica_rank: int = 0


def is_expert(p) -> bool:
    """A routed expert's tensor (split over expert-parallel ranks)."""
    return getattr(getattr(p, "meta", None), "expert", False)


def fp8_weights(chunks) -> dict:
    """``{weight: (policy, parts)}`` of the layers whose GEMMs run in FP8 (a dense 2-D weight; ``parts``:
    the forward runs one GEMM per part of interleaved rows, ``gemm_row_parts`` of the layer). Weights of a
    block-scaled recipe whose rows are not whole blocks (MX: 32 elements) are left out (gathered in high
    precision)."""
    found = {}
    for chunk in chunks:
        for module in chunk.modules():
            policy, weight = getattr(module, "gemm", None), module._parameters.get("weight")
            if (not isinstance(policy, Fp8Policy) or weight is None or weight.dim() != 2 or is_expert(weight)
                    or weight.shape[1] % policy.recipe.block):
                continue
            found[weight] = (policy, getattr(module, "gemm_row_parts", 1))
    return found


def last_backward(grad_sync):
    """``grad_sync.last_backward()``, or nothing when the schedule was given no engine."""
    return grad_sync.last_backward() if grad_sync is not None else contextlib.nullcontext()


def deferring_weight_grads(grad_sync, queue: DeferredWeightGrads):
    """``grad_sync.deferring(queue)``, or nothing when the schedule was given no engine (then no layer
    fuses its weight gradient: autograd's gradients arrive in the backward itself)."""
    return grad_sync.deferring(queue) if grad_sync is not None else contextlib.nullcontext(queue)


class DataParallel:
    """Gradient buffers and their reduction for this rank's model chunks: initialised chunks (their
    parameters are copied into the buffers) or chunks built on the meta device (their parameters are
    replaced by views of the buffers, to be initialised in place afterwards)."""

    def __init__(self, chunks, topo, config: DataParallelConfig):
        self.topo, self.config = topo, config
        self.distributed = config.shards_optim  # the optimizer owns one slice of every bucket
        self.shard_grads, self.shard_params = config.shards_grads, config.shards_params
        if self.distributed:
            dense = ReduceGroup(topo.dp_shard_group, topo.dp_shard_size, topo.dp_shard_rank,
                                topo.dp_replica_group, topo.dp_replica_size, topo.dp_replica_rank)
        else:
            dense = ReduceGroup(topo.dp_cp_group, topo.dp_cp_size, 0)
        self.group, self.size, rank = dense.group, dense.size, dense.rank
        self.replica_group, self.replicas, self.replica_rank = dense.replica_group, dense.replicas, dense.replica_rank
        # expert parallelism: experts reduce over their own group (dense runs keep a single kind of buffer)
        self.expert_parallel = getattr(topo, "ep", 1) > 1
        expert = (ReduceGroup(topo.expert_dp_group, topo.expert_dp_size, topo.expert_dp_rank if self.distributed else 0)
                  if self.expert_parallel else dense)
        self.overlap_grad_reduce = config.overlap_grad_reduce
        self.overlap_param_gather = config.overlap_param_gather and self.distributed and not self.shard_params
        self.reshard_after_forward = config.reshard_after_forward
        chunk_of = {p: k for k, chunk in enumerate(chunks) for p in chunk.parameters()}
        params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
        # ZeRO-3 gathers FP8 layers' weights in FP8: they get buffers of their own (one recipe per buffer)
        fp8 = fp8_weights(chunks) if self.shard_params and config.fp8_param_gather and dense.size > 1 else {}
        by_kind = {}
        for p in reversed(params):  # backward produces gradients in roughly reverse order
            recipe = fp8[p][0].name if p in fp8 else None
            by_kind.setdefault((p.dtype, self.expert_parallel and is_expert(p), recipe), []).append(p)
        self.buffers = []
        for (dtype, experts, recipe), ps in by_kind.items():
            reduce = expert if experts else dense
            shards = (reduce.rank, reduce.size) if self.distributed else (0, 1)
            # ZeRO-3: a bucket never spans two model chunks, so one chunk's forward frees what it gathered
            starts = {i for i in range(1, len(ps)) if chunk_of[ps[i]] != chunk_of[ps[i - 1]]} if self.shard_params else ()
            buf = ParamAndGradBuffer(ps, dtype, config.bucket_size, *shards, topo.device,
                                     self.shard_grads, self.shard_params, starts,
                                     align=fp8_recipe(recipe).block if recipe else 1)  # blocks never straddle slices
            buf.reduce, buf.experts, buf.fp8 = reduce, experts, recipe
            self.buffers.append(buf)
        replaced = {k: v for buf in self.buffers for k, v in buf.replaced.items()}
        if replaced:  # parameters built on the meta device now live in the buffers: put them in the modules
            for chunk in chunks:
                for module in chunk.modules():
                    for name, p in list(module._parameters.items()):
                        if p is not None and id(p) in replaced:
                            module._parameters[name] = replaced[id(p)]
            # keyed by the parameters the modules now hold
            chunk_of = {p: k for k, chunk in enumerate(chunks) for p in chunk.parameters()}
            params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
        self.buckets = [b for buf in self.buffers for b in buf.buckets]
        for i, bucket in enumerate(self.buckets):
            bucket.index = i
        if fp8:  # the modules hold the buffers' parameters now
            by_param = {p: entry for p, entry in fp8_weights(chunks).items()}
            for buf in self.buffers:
                for bucket in buf.buckets if buf.fp8 else ():
                    weights = [Fp8Weight(p, *by_param[p], off - bucket.start) for p, off in bucket.params]
                    bucket.fp8 = BucketFp8Gather(bucket, weights, buf.fp8)
        self.bucket_of = {p: b for b in self.buckets for p, _ in b.params}
        self.params = params
        self.forward_order = forward_order(chunks, self.bucket_of, borrowed=self.shard_params)
        self._final = False  # inside last_backward()
        self._expected = None  # split schedules: gradients each parameter receives this step (else None)
        self._arrived = {}  # parameter -> gradients received this step (counted under expect_contributions)
        self._pending = {}  # bucket index -> parameters whose final gradient has not arrived
        self._grad_handles, self._param_handles = {}, {}
        self._issued = None  # inside lockstep(): the per-micro-batch collectives issued, (kind, bucket, phase)
        # bytes this rank sent per collective kind (ring volume: (n-1)/n of the full buffer; all-reduce twice)
        self.traffic = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        self.weight_grads = WeightGradSink()  # where the layers' W passes go: now, or a split schedule's queue
        self._hooks = []  # every hook this engine registered: close() removes them
        for p in params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
            # layers that compute their own weight gradient add it straight into the fp32 accumulator
            p.accumulate_grad = self.weight_grads.accumulator(functools.partial(self.accumulate_grad, p))
        if self.overlap_param_gather:
            for chunk in chunks:
                for module in chunk.modules():
                    own = [p for p in module.parameters(recurse=False) if p in self.bucket_of]
                    if own:
                        indices = {self.bucket_of[p].index for p in own}
                        indices = [i for i in self.forward_order if i in indices]
                        self._hooks.append(module.register_forward_pre_hook(
                            lambda m, args, ix=indices: self._wait_params(ix)))
        self.gatherer = ParamGatherer(self, chunks, chunk_of) if self.shard_params else None
        if self.gatherer is not None:
            self._hooks.extend(self.gatherer.hooks)
        self.zero_grad()

    def close(self) -> None:
        """Detach the engine from the model: its hooks removed, the parameters' ``accumulate_grad`` and
        ``main_grad`` dropped, so that nothing the model holds keeps the engine or its buffers alive (a
        model that trains on needs a new engine). Idempotent."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for p in self.params:
            for name in ("accumulate_grad", "main_grad"):
                if name in p.__dict__:
                    delattr(p, name)

    # -- gradients ---------------------------------------------------------------------------------
    def zero_grad(self):
        """Start a step: no parameter has a gradient of it yet; no bucket has its final gradients yet.

        Unsharded gradients are not zeroed here: each parameter's first gradient of the step is written
        over its ``main_grad`` (a GEMM with beta 0, a copy), the later ones added, and
        :meth:`finish_grad_sync` zeroes those of parameters that received none. That is one write of the
        whole fp32 buffer less per step, and a read less in every first weight-gradient GEMM. (The buffer's
        padding is never written: zero since it was made.) Sharded gradient slices are zeroed: each
        micro-batch's reduce-scatter adds into them."""
        assert not self._grad_handles, "zero_grad() while gradient reductions are in flight"
        if self.shard_grads:
            for buf in self.buffers:
                buf.grad_data.zero_()
        self._unwritten = set() if self.shard_grads else set(self.params)
        for p in self.params:
            p.grad = None
        self._pending = {b.index: {p for p, _ in b.params} for b in self.buckets}
        self._unflushed = {b.index: {p for p, _ in b.params} for b in self.buckets}  # sharded grads
        self._flushes = []  # sharded grads: (work, slice sum, bucket) in flight
        for bucket in self.buckets:
            bucket.scratch = None
        self._launched = set()
        self._synced = False
        self._expected, self._arrived = None, {}

    def expect_contributions(self, count: int) -> None:
        """This step every parameter receives ``count`` gradients (one per micro-batch); the one that
        completes the count is final, whichever pass brings it (a split schedule: its I or its W)."""
        self._expected, self._arrived = count, {}

    def input_grads_done(self) -> None:
        """An input-gradient pass is over; its weight-gradient products read no parameter (only each
        layer's input and output gradient), so ZeRO-3 frees the buckets it gathered for that backward
        now instead of holding them until the W pass."""
        if self.gatherer is not None:
            self.gatherer.release_held()

    def deferring(self, queue: DeferredWeightGrads):
        """The weight-gradient products the layers hand over inside go to ``queue`` (yielded), run later
        by its owner (a split schedule's W); autograd's gradients still arrive at once."""
        return self.weight_grads.deferring(queue)

    @contextlib.contextmanager
    def last_backward(self):
        """Backward passes run inside deliver final gradients (see the module docstring)."""
        self._final = True
        try:
            yield
        finally:
            self._final = False

    def _on_grad(self, p):
        """The post-accumulate-grad hook: autograd's ``p.grad`` is added to the accumulator and freed."""
        if p.grad is None:  # the layer has added this backward's gradient itself (accumulate_grad)
            return
        grad, p.grad = p.grad, None
        self.accumulate_grad(p, lambda main, overwrite: add_product(main, grad, overwrite))

    def accumulate_grad(self, p, add):
        """One backward's gradient of ``p`` arrives: ``add(main, overwrite)`` adds it into ``main``, the fp32
        tensor of ``p``'s shape that accumulates it (``p.main_grad``, or under sharded gradients p's part of
        the bucket's scratch), or writes it there where ``overwrite`` (``p``'s first gradient of the step:
        see :meth:`zero_grad`), then the bucket's reduction starts if that was the last gradient it awaited.

        Parameters carry this as ``p.accumulate_grad(add)``: a layer that computes its weight gradient
        itself adds the GEMM's product here directly, in fp32, instead of returning a ``p.grad`` in the
        parameter's dtype (bf16) that the hook then adds (Megatron's gradient-accumulation fusion)."""
        bucket = self.bucket_of[p]
        final = self._final
        if self._expected is not None:
            arrived = self._arrived[p] = self._arrived.get(p, 0) + 1
            if arrived > self._expected:
                raise RuntimeError(f"parameter of shape {tuple(p.shape)} received gradient {arrived} of the "
                                   f"{self._expected} expected this step")
            final = arrived == self._expected
        if self.shard_grads:
            self._accumulate_sharded(p, bucket, add)
            return
        if bucket.index in self._launched:
            raise RuntimeError("a gradient arrived after its bucket was reduced: the schedule ran more than one "
                               "backward per chunk inside last_backward()")
        overwrite = p in self._unwritten
        self._unwritten.discard(p)
        add(p.main_grad, overwrite)
        if final:
            pending = self._pending[bucket.index]
            pending.discard(p)
            if not pending and self.overlap_grad_reduce:
                self._reduce(bucket)

    def _accumulate_sharded(self, p, bucket, add):
        """ZeRO-2/3: accumulate into the bucket's scratch; reduce-scatter it once every parameter of the
        bucket has contributed (sums are linear: flushing early or late changes only the traffic)."""
        off = bucket.buffer.offset[p]
        add(bucket.grads[off - bucket.start: off - bucket.start + p.numel()].view(p.shape), False)
        unflushed = self._unflushed[bucket.index]
        unflushed.discard(p)
        if not unflushed:
            self._flush(bucket)
        if self.shard_params:
            self.gatherer.after_grad(p, bucket)

    def _flush(self, bucket):
        """Reduce-scatter the bucket's scratch into this rank's gradient slice (added to it) and free it."""
        self._unflushed[bucket.index] = {q for q, _ in bucket.params}
        scratch, bucket.scratch = bucket.scratch, None
        if scratch is None:
            return
        reduce = bucket.buffer.reduce
        if reduce.size == 1:
            bucket.grad_shard.add_(scratch)
            return
        out = torch.empty_like(bucket.grad_shard)
        self.record("reduce_scatter", bucket.index)
        self.count("reduce_scatter", scratch, reduce.size)
        work = reduce_scatter_flat(out, scratch, group=reduce.group, async_op=self.overlap_grad_reduce)
        self._flushes.append((work, out, bucket, scratch))
        if not self.overlap_grad_reduce or len(self._flushes) > 2:  # at most two scratches in flight
            self._wait_flushes(keep=0 if not self.overlap_grad_reduce else 2)

    def _wait_flushes(self, keep=0):
        while len(self._flushes) > keep:
            work, out, bucket, _ = self._flushes.pop(0)
            if work is not None:
                work.wait()
            bucket.grad_shard.add_(out)

    def _reduce(self, bucket):
        """Launch the bucket's sum over dp x cp (asynchronous; waited for in finish_grad_sync)."""
        self._launched.add(bucket.index)
        reduce = bucket.buffer.reduce
        if reduce.size == 1:
            return
        if self.distributed:
            self.count("reduce_scatter", bucket.grads, reduce.size)
            work = reduce_scatter_flat(bucket.grad_shard, bucket.grads, group=reduce.group, async_op=True)
        else:
            self.count("all_reduce", bucket.grads, reduce.size)
            work = dist.all_reduce(bucket.grads, group=reduce.group, async_op=True)
        self._grad_handles[bucket.index] = work

    def grad_pieces(self):
        """``(param, gradient tensor)`` of every parameter's part this rank reduces: the whole
        ``main_grad`` unless gradients are sharded, else the parameter's part of the rank's slices."""
        if not self.shard_grads:
            return [(p, p.main_grad) for p in self.params]
        return [(p, bucket.grad_piece(lo, hi)) for buf in self.buffers for p, bucket, lo, hi in buf.pieces()]

    def finish_grad_sync(self):
        """Launch the reductions not yet started, wait for all, then run the layout's reductions
        (grads.py: sequence-parallel tp sum, tied-embedding sum). Afterwards every ``main_grad`` (with
        the distributed optimizer: this rank's slice of it) is the gradient of the global loss.
        Idempotent within a step."""
        if self._synced:
            return
        if self.shard_grads:
            for bucket in self.buckets:
                if bucket.scratch is not None:
                    self._flush(bucket)
            self._wait_flushes()
        else:
            for p in self._unwritten:  # received no gradient this step (a bucket holding one was not launched)
                p.main_grad.zero_()
            self._unwritten.clear()
            for bucket in self.buckets:
                if bucket.index not in self._launched:
                    self._reduce(bucket)
            for work in self._grad_handles.values():
                work.wait()
            self._grad_handles.clear()
        for buf in self.buffers:  # hybrid sharding: sum each reduced slice over the replicas of the shard
            if buf.reduce.replicas > 1:
                for shard in [buf.grad_data] if self.shard_grads else [b.grad_shard for b in buf.buckets]:
                    self.count("all_reduce", shard, buf.reduce.replicas)
                    dist.all_reduce(shard, group=buf.reduce.replica_group)
        all_reduce_layout_grads(self.grad_pieces(), self.topo)
        if self.shard_params:
            self.gatherer.release_all()
        self._synced = True

    # -- uneven batch shares: phantom micro-batches -------------------------------------------------
    def record(self, kind: str, index: int, phase=None) -> None:
        """A per-micro-batch collective of the shard group is issued for bucket ``index`` (recorded
        inside :meth:`lockstep`, for :meth:`join_microbatch` to issue again)."""
        if self._issued is not None:
            self._issued.append((kind, index, phase))

    @contextlib.contextmanager
    def lockstep(self, count: int, joined: int):
        """Run this replica's ``count`` micro-batches inside (one schedule, training or forward-only); on
        leaving, join the per-micro-batch collectives of ``joined - count`` more (:meth:`join_microbatch`),
        ``joined`` being the micro-batches every rank of the shard groups runs this step (the largest
        share). Nothing is recorded or joined when ``joined == count``."""
        if joined <= count:
            yield
            return
        self._issued = []
        try:
            yield
            issued = self._issued
        finally:
            self._issued = None
        pattern = self._one_microbatch(issued, count)
        for _ in range(joined - count):
            self.join_microbatch(pattern)

    def _one_microbatch(self, issued: list, count: int) -> list:
        """The collectives of one micro-batch: ``issued`` over ``count`` micro-batches must repeat one
        micro-batch's, each leaving nothing gathered or accumulated behind, or no phantom can stand for
        a micro-batch."""
        n = len(issued) // count
        pattern = issued[:n]
        leftover = sorted({b.index for b in self.buckets if b.scratch is not None}
                          | set(self.gatherer.gathered_buckets() if self.gatherer is not None else ()))
        if issued != pattern * count or leftover:
            raise RuntimeError(f"uneven batch shares: the {count} micro-batches of this step issued {len(issued)} "
                               f"shard-group collectives that do not repeat one micro-batch's (buckets still "
                               f"gathered or accumulating: {leftover}): no phantom micro-batch can join them")
        if pattern and self.topo.pp_size > 1:
            raise RuntimeError("uneven batch shares: phantom micro-batches follow no pipeline schedule (pp > 1)")
        return pattern

    def join_microbatch(self, pattern: list) -> None:
        """Join the shard-group collectives of one micro-batch without computing (a phantom micro-batch):
        ``pattern`` as :meth:`lockstep` recorded it, issued in its order through the same code, one
        bucket at a time. A parameter all-gather sends this rank's slice and drops the gathered bucket at
        once; a gradient reduce-scatter contributes zeros and adds what it receives (the other ranks'
        sum of this rank's slice) to the rank's gradient slice, as a real micro-batch's does."""
        for kind, index, phase in pattern:
            bucket = self.buckets[index]
            if kind == "all_gather":
                self.gatherer.gather(index, phase=phase)
                self.gatherer.release(index)
            else:
                bucket.scratch = torch.zeros(bucket.numel, dtype=torch.float32, device=bucket.grad_shard.device)
                self._flush(bucket)

    # -- parameters (distributed optimizer) ---------------------------------------------------------
    def start_param_sync(self):
        """All-gather every bucket's updated slices into the parameter buffers (asynchronously when
        ``overlap_param_gather``: the next forward waits per module). ZeRO-3 gathers in the forward."""
        if not self.distributed or self.shard_params:
            return
        for i in self.forward_order:  # the first forward hook waits for the first gather issued
            bucket = self.buckets[i]
            reduce = bucket.buffer.reduce
            if reduce.size == 1:
                continue
            self.count("all_gather", bucket.data, reduce.size)
            work = all_gather_flat(bucket.data, bucket.data_shard, group=reduce.group, async_op=self.overlap_param_gather)
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

    def param_shards(self):
        """This rank's share of every parameter, ``(param, lo, hi, data)``: elements ``[lo, hi)`` of the
        flattened local parameter and the buffer view holding them. Under ZeRO-3 these packed slices are
        the parameters' only values outside a forward (checkpoints read and write them); otherwise they
        are views into the full local parameters."""
        return [x for buf in self.buffers for x in buf.shard_ranges()]

    def counts_in_norm(self, p) -> bool:
        """Whether this rank counts its piece of ``p`` in the global gradient norm, which is then summed
        over the whole job when :attr:`norm_over_world` (else over tp x pp): each element of the full
        model once. Dense: once over tp (``meta.counted_in_norm``) and once over the replicas of a slice;
        routed experts under expert parallelism: once over their expert-dp group (they differ over ep)
        and once over etp."""
        meta = p.meta
        if self.expert_parallel and is_expert(p):
            once_over_etp = meta.split_dim is not None or self.topo.etp_rank == 0
            return meta.copy_of is None and once_over_etp and (self.distributed or self.topo.expert_dp_rank == 0)
        once_over_dp = self.distributed or not self.expert_parallel or self.topo.dp_cp_rank == 0
        return meta.counted_in_norm and self.replica_rank == 0 and once_over_dp

    @property
    def norm_over_world(self) -> bool:
        """The norm's partial sums are summed over every rank: sharded slices, or experts that differ over ep."""
        return self.distributed or self.expert_parallel

    def count(self, kind, full, ranks):
        """Account a collective over ``ranks`` whose full (unsharded) buffer is ``full``."""
        volume = full.numel() * full.element_size() * (ranks - 1) // ranks
        self.traffic[kind] += 2 * volume if kind == "all_reduce" else volume

    @property
    def max_gathered(self) -> int:
        """The most ZeRO-3 buckets gathered at once so far (0 without ZeRO-3)."""
        return self.gatherer.max_gathered if self.gatherer else 0

    def resident_bytes(self) -> int:
        """Bytes of parameters and gradients this engine holds now: its buffers (packed slices when
        sharded), plus any gathered ZeRO-3 bucket and any gradient scratch."""
        total = sum(buf.param_data.numel() * buf.param_data.element_size() + buf.grad_data.numel() * 4
                    for buf in self.buffers)
        for bucket in self.buckets:
            if bucket.full is not None:
                total += bucket.full.untyped_storage().size()
            if bucket.fp8 is not None:
                total += bucket.fp8.nbytes
            if bucket.scratch is not None:
                total += bucket.scratch.numel() * 4
        return total
