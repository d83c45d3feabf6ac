"""Forward/backward schedules over the micro-batches of one step.

What each rank runs, and in which order, is its action list (megand/core/pipeline_parallel/actions.py,
the one description of the schedules, which the planner's replay and the memory estimator read too);
:func:`run_actions` runs it. A schedule calls ``forward_step(chunk, microbatch, hidden)``, which returns
the chunk's output: hidden states, or on the last stage the micro-batch's loss already divided by the
global batch's token count (so summing micro-batches and data-parallel replicas gives the global mean).
It returns the summed loss (detached) on the last stage, ``None`` elsewhere.

- no pipelining (pp=1): gradient accumulation, one micro-batch alive at a time;
- 1F1B (pp>1): stage r runs ``pp-r-1`` warm-up forwards, then alternates one forward and one backward,
  then drains the remaining backwards; stage 0 holds at most pp micro-batches of activations.
  ``forward_backward_fill_drain`` (GPipe: all forwards, then all backwards) holds m; it is kept for
  comparison;
- interleaved 1F1B (pp>1, vpp chunks per rank): Megatron's schedule, micro-batches in groups of pp run
  through chunk 0, then chunk 1, ...; the bubble shrinks by v.

``grad_sync`` (the data-parallel engine, or None) sees the last backward of the step of each chunk run
inside ``last_backward(grad_sync)``, so it can start reducing that chunk's gradient buckets while the
other chunks still run backward (megand/core/distributed/data_parallel.py). ``stats`` (optional
:class:`ScheduleStats`) collects compute/communication time and the peak number of
micro-batches whose activations are stored, for the bubble tool and the tests.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from megand.core.distributed import last_backward
from megand.core.pipeline_parallel.actions import BACKWARD, FORWARD, schedule_actions
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


def run_actions(actions, chunks, microbatches, forward_step, topo, forward_only=False, stats=None, grad_sync=None):
    """Run this rank's action list (megand/core/pipeline_parallel/actions.py) over ``microbatches``.

    Each action's receive is posted with the previous action's send, in one call (the first action's
    alone), so a stage that sends one way and receives the other at once cannot deadlock against its
    neighbour doing the mirror call; :class:`PipelineP2P` prefetches receives and leaves sends in
    flight while the next action computes. Messages in each direction arrive in the order they are
    sent, and the action lists consume them in that order, so each receive is the input of the action
    it is posted for.
    """
    steps = _Steps(chunks, forward_step, topo, forward_only, stats, len(microbatches), grad_sync)
    p2p = _p2p(chunks, microbatches, topo, steps, actions) if topo.pp_size > 1 else None
    inputs, outputs = {}, {}  # (chunk, micro-batch) -> the forward's input and output, kept for its backward
    received = _communicate(p2p, None, None, actions[0] if actions else None)
    for index, action in enumerate(actions):
        key = action.chunk, action.microbatch
        send_next = send_prev = None
        if action.kind == FORWARD:
            output = steps.forward(action.chunk, microbatches[action.microbatch], received)
            if not forward_only:
                inputs[key], outputs[key] = received, output
            if action.send_to is not None:
                send_next = output
        elif action.kind == BACKWARD:
            input_grad = steps.backward(inputs.pop(key), outputs.pop(key), received, action.chunk)
            if action.send_to is not None:
                send_prev = input_grad
        else:
            raise ValueError(f"pipeline schedule: no executor for action kind {action.kind!r}")
        following = actions[index + 1] if index + 1 < len(actions) else None
        received = _communicate(p2p, send_next, send_prev, following)
    if p2p is None:
        return steps.finish()
    return _finish(p2p, steps, topo, stats)


def _communicate(p2p, send_next, send_prev, following):
    """Post the sends of the action just run with the receive of ``following``; return what it receives."""
    if p2p is None:
        return None
    recv_prev = following is not None and following.kind == FORWARD and following.recv_from is not None
    recv_next = following is not None and following.kind != FORWARD and following.recv_from is not None
    if send_next is None and send_prev is None and not recv_prev and not recv_next:
        return None
    from_prev, from_next = p2p.communicate(send_next=send_next, send_prev=send_prev, recv_prev=recv_prev,
                                           recv_next=recv_next)
    return from_prev if recv_prev else from_next


def _actions(chunks, microbatches, topo, forward_only, fill_drain=False):
    actions = schedule_actions(topo.pp_size, len(chunks), len(microbatches), topo.pp_rank, fill_drain=fill_drain,
                               forward_only=forward_only)
    if topo.pp_size > 1:  # the p2p links only neighbours (the placement's peers must be those)
        prev, next_ = (topo.pp_rank - 1) % topo.pp_size, (topo.pp_rank + 1) % topo.pp_size
        for action in actions:
            peers = (prev, next_) if action.kind == FORWARD else (next_, prev)
            if action.recv_from not in (None, peers[0]) or action.send_to not in (None, peers[1]):
                raise ValueError(f"pipeline rank {topo.pp_rank}: {action} talks to a rank that is not its "
                                 f"neighbour ({prev} before, {next_} after); the pipeline p2p links neighbours only")
    return actions


def forward_backward_no_pipelining(chunks, microbatches, forward_step, topo, forward_only=False, stats=None,
                                   grad_sync=None):
    """Gradient accumulation: forward and backward of each micro-batch in turn (pp == 1)."""
    actions = schedule_actions(1, 1, len(microbatches), 0, forward_only=forward_only)
    return run_actions(actions, chunks, microbatches, forward_step, topo, forward_only, stats, grad_sync)


def _p2p(chunks, microbatches, topo, steps, actions):
    """The stage's p2p, told what it receives this step: an activation for every forward that has a
    sender, a gradient for every backward that has one."""
    cfg = chunks[0].cfg
    p2p = PipelineP2P(topo, tensor_shape(cfg, microbatches[0], topo), cfg.params_dtype)
    from_prev = sum(1 for a in actions if a.kind == FORWARD and a.recv_from is not None)
    from_next = sum(1 for a in actions if a.kind != FORWARD and a.recv_from is not None)
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
                                                     stats=None, grad_sync=None):
    """1F1B (one chunk per rank)."""
    (_,) = chunks
    actions = _actions(chunks, microbatches, topo, forward_only)
    return run_actions(actions, chunks, microbatches, forward_step, topo, forward_only, stats, grad_sync)


def forward_backward_fill_drain(chunks, microbatches, forward_step, topo, forward_only=False, stats=None,
                                grad_sync=None):
    """GPipe: every forward, then every backward; stage 0 holds all m micro-batches (for comparison)."""
    (_,) = chunks
    actions = _actions(chunks, microbatches, topo, forward_only, fill_drain=True)
    return run_actions(actions, chunks, microbatches, forward_step, topo, forward_only, stats, grad_sync)


def forward_backward_pipelining_with_interleaving(chunks, microbatches, forward_step, topo, forward_only=False,
                                                  stats=None, grad_sync=None):
    """Interleaved 1F1B over v = len(chunks) model chunks per rank; chunk c of rank r is virtual stage c*pp + r."""
    actions = _actions(chunks, microbatches, topo, forward_only)
    return run_actions(actions, chunks, microbatches, forward_step, topo, forward_only, stats, grad_sync)


def get_schedule(topo, fill_drain=False):
    """The schedule for this layout: no pipelining (pp=1), 1F1B, or interleaved 1F1B (vpp > 1)."""
    if topo.pp_size == 1:
        return forward_backward_no_pipelining
    if fill_drain:
        return forward_backward_fill_drain
    if topo.vpp is not None and topo.vpp > 1:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving

