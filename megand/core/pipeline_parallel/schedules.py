"""Forward/backward schedules over the micro-batches of one step.

A schedule calls ``forward_step(chunk, microbatch, hidden)``, which returns the chunk's output: hidden
states, or on the last stage the micro-batch's loss already divided by the global batch's token count
(so summing micro-batches and data-parallel replicas gives the global mean). It returns the summed
loss (detached) on the last stage, ``None`` elsewhere.

- no pipelining (pp=1): gradient accumulation, one micro-batch alive at a time;
- 1F1B (pp>1): stage r runs ``pp-r-1`` warm-up forwards, then alternates one forward and one backward,
  then drains the remaining backwards; stage 0 holds at most pp micro-batches of activations.
  ``forward_backward_fill_drain`` (GPipe: all forwards, then all backwards) is the same code with m
  warm-up forwards and holds m; it is kept for comparison;
- interleaved 1F1B (pp>1, vpp chunks per rank): Megatron's schedule, micro-batches in groups of pp run
  through chunk 0, then chunk 1, ...; the bubble shrinks by v.

``grad_sync`` (the data-parallel engine, or None) sees the last backward of the step of each chunk run
inside ``last_backward(grad_sync)``, so it can start reducing that chunk's gradient buckets while the
other chunks still run backward (megand/core/distributed/data_parallel.py). ``stats`` (optional :class:`ScheduleStats`) collects compute/communication time and the peak number of
micro-batches whose activations are stored, for the bubble tool and the tests.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from megand.core.distributed import last_backward
from megand.core.pipeline_parallel.p2p import PipelineP2P, tensor_shape
from megand.core.timing import device_timer


class _Timed:
    """Times the compute of a schedule when statistics are asked for (nothing otherwise)."""

    def __init__(self, device):
        self.timer = device_timer(device)

    def __enter__(self):
        self.timer.start()

    def __exit__(self, *exc):
        self.timer.stop()


@dataclass
class ScheduleStats:
    # measured by the device's timer (megand/core/timing.py): device time on CUDA, wall time on the CPU
    compute_seconds: float = 0.0  # time inside forward and backward steps
    comm_seconds: float = 0.0  # time posting and waiting on pipeline p2p
    peak_live: int = 0  # most micro-batch forwards stored at once (awaiting their backward)
    live: int = 0


class _Steps:
    """Forward and backward of one micro-batch on one chunk, with the loss sum and the bookkeeping."""

    def __init__(self, chunks, forward_step, topo, forward_only, stats, num_microbatches, grad_sync):
        self.chunks, self.forward_step, self.forward_only = chunks, forward_step, forward_only
        self.stats = stats or ScheduleStats()
        self.timed = _Timed(topo.device) if stats is not None else nullcontext()
        self.num_microbatches, self.grad_sync = num_microbatches, grad_sync
        self.backwards_done = [0] * len(chunks)
        self.total = torch.zeros((), dtype=torch.float32, device=topo.device)
        self.p2p = None  # pipeline schedules: receives to post before each compute (PipelineP2P.prefetch)

    def forward(self, chunk_id, microbatch, input_tensor):
        if self.p2p is not None:
            self.p2p.prefetch()  # the next receives arrive while this forward runs
        chunk = self.chunks[chunk_id]
        if input_tensor is not None and not self.forward_only:
            input_tensor.requires_grad_()
        with self.timed:
            output = self.forward_step(chunk, microbatch, input_tensor)
            if chunk.post_process:
                self.total += output.detach().float()
        if not self.forward_only:
            self.stats.live += 1
            self.stats.peak_live = max(self.stats.peak_live, self.stats.live)
        return output

    def backward(self, input_tensor, output, output_grad, chunk_id=0):
        """Backpropagate from ``output`` (the loss on the last stage, where ``output_grad`` is None);
        return the gradient of the chunk's input (None on the first stage)."""
        if self.p2p is not None:
            self.p2p.prefetch()
        self.backwards_done[chunk_id] += 1
        with self.timed:
            if self.backwards_done[chunk_id] == self.num_microbatches:  # this chunk's gradients become final
                with last_backward(self.grad_sync):
                    torch.autograd.backward(output, grad_tensors=output_grad)
            else:
                torch.autograd.backward(output, grad_tensors=output_grad)
        self.stats.live -= 1
        return None if input_tensor is None else input_tensor.grad

    def finish(self) -> torch.Tensor:
        """The schedule's loss sum; the compute time added to the statistics (on CUDA: a read of the
        timing events, which waits for the step's queued work; only where statistics are asked for)."""
        if isinstance(self.timed, _Timed):
            self.stats.compute_seconds += self.timed.timer.seconds
        return self.total


def forward_backward_no_pipelining(chunks, microbatches, forward_step, topo, forward_only=False, stats=None,
                                   grad_sync=None):
    """Gradient accumulation: forward and backward of each micro-batch in turn (pp == 1)."""
    steps = _Steps(chunks, forward_step, topo, forward_only, stats, len(microbatches), grad_sync)
    for microbatch in microbatches:
        loss = steps.forward(0, microbatch, None)
        if not forward_only:
            steps.backward(None, loss, None)
    return steps.finish()


def _p2p(chunks, microbatches, topo, steps, forward_only):
    """The stage's p2p, told what it receives this step: an activation for every forward but those of
    the first virtual stage, a gradient for every backward but those of the last."""
    cfg = chunks[0].cfg
    p2p = PipelineP2P(topo, tensor_shape(cfg, microbatches[0], topo), cfg.params_dtype)
    m, v = len(microbatches), len(chunks)
    from_prev = m * v - (m if chunks[0].pre_process else 0)
    from_next = 0 if forward_only else m * v - (m if chunks[-1].post_process else 0)
    p2p.expect(from_prev, from_next)
    steps.p2p = p2p
    return p2p


def _finish(p2p, steps, topo, stats):
    p2p.finish()  # the last sends complete before the step goes on
    if stats is not None:
        stats.comm_seconds += p2p.comm_seconds
    total = steps.finish()
    return total if topo.is_last_stage else None


def forward_backward_pipelining_without_interleaving(chunks, microbatches, forward_step, topo, forward_only=False,
                                                     stats=None, grad_sync=None, num_warmup=None):
    """1F1B (one chunk per rank). ``num_warmup`` overrides the warm-up forwards (m: fill-drain)."""
    (_,) = chunks
    m = len(microbatches)
    steps = _Steps(chunks, forward_step, topo, forward_only, stats, m, grad_sync)
    p2p = _p2p(chunks, microbatches, topo, steps, forward_only)
    first, last = topo.is_first_stage, topo.is_last_stage
    if forward_only:
        num_warmup = m
    elif num_warmup is None:
        num_warmup = min(topo.pp_size - topo.pp_rank - 1, m)
    num_steady = m - num_warmup
    inputs, outputs = [], []  # stored for the backward, oldest first

    def send_forward(output):
        if not last:
            p2p.send_forward(output)

    for i in range(num_warmup):  # warm-up: forwards only
        input_tensor = p2p.recv_forward(recv=not first)
        output = steps.forward(0, microbatches[i], input_tensor)
        send_forward(output)
        if not forward_only:
            inputs.append(input_tensor)
            outputs.append(output)

    input_tensor = p2p.recv_forward(recv=not first) if num_steady > 0 else None
    for i in range(num_steady):  # steady state: one forward, one backward
        output = steps.forward(0, microbatches[num_warmup + i], input_tensor)
        output_grad = None if last else p2p.send_forward_recv_backward(output)
        inputs.append(input_tensor)
        outputs.append(output)
        input_grad = steps.backward(inputs.pop(0), outputs.pop(0), output_grad)
        if i == num_steady - 1:
            if not first:
                p2p.send_backward(input_grad)
        else:
            input_tensor = p2p.send_backward_recv_forward(None if first else input_grad, recv=not first)

    if not forward_only:
        for _ in range(num_warmup):  # cool-down: the remaining backwards
            output_grad = p2p.recv_backward(recv=not last)
            input_grad = steps.backward(inputs.pop(0), outputs.pop(0), output_grad)
            if not first:
                p2p.send_backward(input_grad)
    return _finish(p2p, steps, topo, stats)


def forward_backward_fill_drain(chunks, microbatches, forward_step, topo, forward_only=False, stats=None,
                                grad_sync=None):
    """GPipe: every forward, then every backward; stage 0 holds all m micro-batches (for comparison)."""
    return forward_backward_pipelining_without_interleaving(chunks, microbatches, forward_step, topo, forward_only,
                                                            stats, grad_sync, num_warmup=len(microbatches))


def forward_backward_pipelining_with_interleaving(chunks, microbatches, forward_step, topo, forward_only=False,
                                                  stats=None, grad_sync=None):
    """Interleaved 1F1B over v = len(chunks) model chunks per rank; chunk c of rank r is virtual stage c*pp + r.

    Step k of this rank's 2·v·m forward/backward sequence works on micro-batch group k // (pp·v),
    chunk (k // pp) % v (reversed for backwards), micro-batch ``group·pp + k % pp``.
    """
    pp, rank, v, m = topo.pp_size, topo.pp_rank, len(chunks), len(microbatches)
    if m % pp:
        raise ValueError(f"interleaved pipelining needs the number of micro-batches ({m}) to be a multiple of pp={pp}")
    total = m * v
    steps = _Steps(chunks, forward_step, topo, forward_only, stats, m, grad_sync)
    p2p = _p2p(chunks, microbatches, topo, steps, forward_only)
    first_rank, last_rank = topo.is_first_stage, topo.is_last_stage

    all_warmup = forward_only or m == pp
    if all_warmup:
        num_warmup = total
    else:
        num_warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    num_steady = total - num_warmup

    def chunk_id(k, forward):
        c = (k % (pp * v)) // pp
        return c if forward else v - 1 - c

    def microbatch_id(k):
        return (k // (pp * v)) * pp + k % pp

    inputs = [[] for _ in range(v)]
    outputs = [[] for _ in range(v)]
    output_grads = [[] for _ in range(v)]

    def forward_k(k):
        c = chunk_id(k, True)
        if chunks[c].pre_process and len(inputs[c]) == len(outputs[c]):
            inputs[c].append(None)  # the first virtual stage reads its micro-batch, receives nothing
        output = steps.forward(c, microbatches[microbatch_id(k)], inputs[c][-1])
        outputs[c].append(output)
        if forward_only:  # nothing to keep for a backward
            inputs[c].pop()
            outputs[c].pop()
        return output

    def backward_k(k):
        c = chunk_id(k, False)
        if chunks[c].post_process and not output_grads[c]:
            output_grads[c].append(None)  # the loss: no gradient comes from a next stage
        return steps.backward(inputs[c].pop(0), outputs[c].pop(0), output_grads[c].pop(0), c)

    # warm-up
    inputs[0].append(p2p.recv_forward(recv=not first_rank))
    for k in range(num_warmup):
        output = forward_k(k)
        if chunks[chunk_id(k, True)].post_process:
            output = None  # the last virtual stage sends nothing on
        next_c = chunk_id(k + 1, True)
        recv_prev = not (first_rank and next_c == 0) and k != total - 1
        if k == num_warmup - 1 and not all_warmup:
            input_tensor, output_grad = p2p.send_forward_backward_recv_forward_backward(
                output, None, recv_prev=recv_prev, recv_next=not last_rank)
            output_grads[v - 1].append(output_grad)
        else:
            input_tensor = p2p.send_forward_recv_forward(output, recv=recv_prev)
        inputs[next_c].append(input_tensor)

    # steady state: one forward and one backward per step
    for k in range(num_steady):
        fk, bk = k + num_warmup, k
        output = forward_k(fk)
        input_grad = backward_k(bk)
        if chunks[chunk_id(fk, True)].post_process:
            output = None
        if chunks[chunk_id(bk, False)].pre_process:
            input_grad = None

        recv_prev = True
        if first_rank:  # what arrives from the last rank now is for the chunk after the one it left
            next_fc = chunk_id(fk - (pp - 1), True)
            if next_fc == v - 1:
                recv_prev = False
            next_fc += 1
        else:
            next_fc = chunk_id(fk + 1, True)
        recv_next = True
        if last_rank:
            next_bc = chunk_id(bk - (pp - 1), False)
            if next_bc == 0:
                recv_next = False
            next_bc -= 1
        else:
            next_bc = chunk_id(bk + 1, False)
        if k == num_steady - 1:
            recv_prev = False
        input_tensor, output_grad = p2p.send_forward_backward_recv_forward_backward(
            output, input_grad, recv_prev=recv_prev, recv_next=recv_next)
        if recv_prev:
            inputs[next_fc].append(input_tensor)
        if recv_next:
            output_grads[next_bc].append(output_grad)

    # cool-down
    if not forward_only:
        if all_warmup:
            output_grads[v - 1].append(p2p.recv_backward(recv=not last_rank))
        for k in range(num_steady, total):
            input_grad = backward_k(k)
            if chunks[chunk_id(k, False)].pre_process:
                input_grad = None
            next_bc = chunk_id(k + 1, False)
            recv_next = not (last_rank and next_bc == v - 1) and k != total - 1
            output_grads[next_bc].append(p2p.send_backward_recv_backward(input_grad, recv=recv_next))
    return _finish(p2p, steps, topo, stats)


def get_schedule(topo, fill_drain=False):
    """The schedule for this layout: no pipelining (pp=1), 1F1B, or interleaved 1F1B (vpp > 1)."""
    if topo.pp_size == 1:
        return forward_backward_no_pipelining
    if fill_drain:
        return forward_backward_fill_drain
    if topo.vpp is not None and topo.vpp > 1:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving

