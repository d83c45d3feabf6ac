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
  through chunk 0, then chunk 1, ...; the bubble shrinks by v;
- zero bubble (``zb1p``, ZB-H1): each backward split into its input-gradient pass ``I`` (run with the
  weight-gradient products of the parallel linear layers queued in a
  :class:`~megand.core.tensor_parallel.wgrad.DeferredWeightGrads` of its own, which the engine's
  parameters hand them to while the I runs: ``grad_sync.deferring``) and its weight-gradient pass ``W``
  (the queue run later, where the rank would otherwise wait).

``grad_sync`` (the data-parallel engine, or None) sees the last backward of the step of each chunk run
inside ``last_backward(grad_sync)`` (a split schedule instead tells it how many gradients each parameter
receives this step, :meth:`DataParallel.expect_contributions`, since a parameter's last one may arrive in
an ``I`` or in a later ``W``), so it can start reducing that chunk's gradient buckets while the
other chunks still run backward (megand/core/distributed/data_parallel.py). ``stats`` (optional
:class:`ScheduleStats`) collects compute/communication time and the peak number of
micro-batches whose activations are stored, for the bubble tool and the tests.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from megand.core.distributed import deferring_weight_grads, last_backward
from megand.core.pipeline_parallel.actions import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, schedule_actions
from megand.core.pipeline_parallel.p2p import ACTIVATION, GRADIENT, PipelineP2P, posting_order, tensor_shape
from megand.core.pipeline_parallel.registry import DEFAULT_SCHEDULE, schedule_record
from megand.core.tensor_parallel.wgrad import DeferredWeightGrads
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
    peak_live: int = 0  # most micro-batch forwards stored at once (awaiting their backward, or their W)
    live: int = 0
    weight_grad_passes: int = 0  # weight-gradient products deferred from an I and run in its W
    kind_seconds: dict = field(default_factory=dict)  # action kind (F, B, I, W) -> compute seconds


class _Steps:
    """Forward and backward of one micro-batch on one chunk, with the loss sum and the bookkeeping."""

    def __init__(self, chunks, forward_step, topo, forward_only, stats, num_microbatches, grad_sync, split=False):
        self.chunks, self.forward_step, self.forward_only = chunks, forward_step, forward_only
        self.split = split  # backwards are split into I and W: the engine counts each parameter's gradients
        if split and grad_sync is not None and not forward_only:
            grad_sync.expect_contributions(num_microbatches)
        self.stats = stats or ScheduleStats()
        self.timers = {kind: _Timed(topo.device) for kind in (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)} \
            if stats is not None else {}
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
        with self.timed(FORWARD):
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
        with self.timed(BACKWARD):
            if self.backwards_done[chunk_id] == self.num_microbatches and not self.split:  # gradients become final
                with last_backward(self.grad_sync):
                    torch.autograd.backward(output, grad_tensors=output_grad)
            else:
                torch.autograd.backward(output, grad_tensors=output_grad)
        self.stats.live -= 1
        return None if input_tensor is None else input_tensor.grad

    def input_grad(self, input_tensor, output, output_grad):
        """The I of a split backward: the chunk's input gradient (returned, None on the first stage) and
        every gradient autograd computes itself; the parallel linear layers' weight-gradient products are
        queued in the returned :class:`DeferredWeightGrads`, for :meth:`weight_grad`."""
        if self.p2p is not None:
            self.p2p.prefetch()
        deferred = DeferredWeightGrads()  # this backward's W pass, owned here until weight_grad runs it
        with self.timed(INPUT_GRAD), deferring_weight_grads(self.grad_sync, deferred):
            torch.autograd.backward(output, grad_tensors=output_grad)
        if self.grad_sync is not None:
            self.grad_sync.input_grads_done()  # ZeRO-3: W reads no parameter, the backward's buckets may go
        return (None if input_tensor is None else input_tensor.grad), deferred

    def weight_grad(self, deferred):
        """The W of a split backward: its queued weight-gradient products, added into the accumulators."""
        with self.timed(WEIGHT_GRAD):
            self.stats.weight_grad_passes += deferred.run()
        self.stats.live -= 1

    def finish(self) -> torch.Tensor:
        """The schedule's loss sum; the compute time added to the statistics (on CUDA: a read of the
        timing events, which waits for the step's queued work; only where statistics are asked for)."""
        for kind, timed in self.timers.items():
            seconds = timed.timer.seconds
            self.stats.kind_seconds[kind] = self.stats.kind_seconds.get(kind, 0.0) + seconds
            self.stats.compute_seconds += seconds
        return self.total

    def timed(self, kind):
        """The timer of ``kind``'s compute where statistics are asked for (nothing otherwise)."""
        return self.timers.get(kind) or nullcontext()


def run_actions(actions, chunks, microbatches, forward_step, topo, forward_only=False, stats=None, grad_sync=None,
                every=None):
    """Run this rank's action list (megand/core/pipeline_parallel/actions.py) over ``microbatches``;
    ``every``: every pipeline rank's list (``actions`` is ``every[topo.pp_rank]``), from which the p2p
    takes the order to post its messages in (:func:`~megand.core.pipeline_parallel.p2p.posting_order`).

    Each action's receive is posted with the previous action's send, in one call (the first action's
    alone), so a stage that sends one way and receives the other at once cannot deadlock against its
    neighbour doing the mirror call; :class:`PipelineP2P` prefetches receives (gloo) and leaves sends
    in flight while the next actions compute. Each kind of message travels each way in the order it
    is sent, and the action lists consume them in that order, so each receive is the input of the
    action it is posted for. Where an action's next virtual stage is on this rank (a V's turn), its
    output is handed over without p2p.
    """
    split = any(a.kind == WEIGHT_GRAD for a in actions)
    steps = _Steps(chunks, forward_step, topo, forward_only, stats, len(microbatches), grad_sync, split)
    p2p = _p2p(chunks, microbatches, topo, steps, actions, every) if topo.pp_size > 1 else None
    links = _Links(p2p, topo)
    inputs, outputs = {}, {}  # (chunk, micro-batch) -> the forward's input and output, kept for its backward
    deferred = {}  # (chunk, micro-batch) -> the weight-gradient products its I queued, for its W
    received = links.communicate(None, None, actions[0] if actions else None)
    for index, action in enumerate(actions):
        key = action.chunk, action.microbatch
        sent = None
        if action.kind == FORWARD:
            output = steps.forward(action.chunk, microbatches[action.microbatch], received)
            if not forward_only:
                inputs[key], outputs[key] = received, output
            sent = output
        elif action.kind == BACKWARD:
            sent = steps.backward(inputs.pop(key), outputs.pop(key), received, action.chunk)
        elif action.kind == INPUT_GRAD:
            sent, deferred[key] = steps.input_grad(inputs.pop(key), outputs.pop(key), received)
        elif action.kind == WEIGHT_GRAD:
            steps.weight_grad(deferred.pop(key))
        else:
            raise ValueError(f"pipeline schedule: no executor for action kind {action.kind!r}")
        following = actions[index + 1] if index + 1 < len(actions) else None
        received = links.communicate(action, sent, following)
    if p2p is None:
        return steps.finish()
    return _finish(p2p, steps, topo, stats, chunks)


def _kind(action):
    """The kind of message an action receives and sends: activations for a forward, gradients else."""
    return ACTIVATION if action.kind == FORWARD else GRADIENT


class _Links:
    """An action's output to the rank its action names, and the input of the next action: through the
    pipeline p2p, or kept on this rank where the placement puts the next virtual stage here too (the
    turn of a V)."""

    def __init__(self, p2p, topo):
        self.p2p, self.me = p2p, topo.pp_rank
        self.peers = topo.ranks["pp"] if p2p is not None else None  # pipeline rank -> global rank
        self.local = {}  # (kind, receiving virtual stage, micro-batch) -> the tensor handed over here

    def communicate(self, action, sent, following):
        """Post the send of ``action`` (its output ``sent``) with the receive of ``following``; return
        what ``following`` receives (None where it receives nothing)."""
        if self.p2p is None:
            return None
        items = []
        if action is not None and action.send_to is not None and sent is not None:
            receiver = action.stage + 1 if action.kind == FORWARD else action.stage - 1
            if action.send_to == self.me:  # the next virtual stage is this rank's other chunk
                self.local[(_kind(action), receiver, action.microbatch)] = sent.detach()
            else:
                items.append(("send", sent, self.peers[action.send_to], _kind(action)))
        local_input = None
        if following is not None and following.recv_from is not None:
            if following.recv_from == self.me:
                local_input = self.local.pop((_kind(following), following.stage, following.microbatch))
            else:
                items.append(("recv", self.peers[following.recv_from], _kind(following)))
        if not items:
            return local_input
        received = self.p2p.exchange(items)
        return received[0] if received else local_input


def _run(chunks, microbatches, forward_step, topo, forward_only, stats, grad_sync, fill_drain=False,
         schedule=DEFAULT_SCHEDULE):
    """Run this rank's action list, with every pipeline rank's (the order of the messages)."""
    every = [schedule_actions(topo.pp_size, len(chunks), len(microbatches), rank, fill_drain=fill_drain,
                              forward_only=forward_only, schedule=schedule) for rank in range(topo.pp_size)]
    return run_actions(every[topo.pp_rank], chunks, microbatches, forward_step, topo, forward_only, stats, grad_sync,
                       every)


def forward_backward_no_pipelining(chunks, microbatches, forward_step, topo, forward_only=False, stats=None,
                                   grad_sync=None):
    """Gradient accumulation: forward and backward of each micro-batch in turn (pp == 1)."""
    actions = schedule_actions(1, 1, len(microbatches), 0, forward_only=forward_only)
    return run_actions(actions, chunks, microbatches, forward_step, topo, forward_only, stats, grad_sync)


def _p2p(chunks, microbatches, topo, steps, actions, every=None):
    """The stage's p2p, told what it receives this step from each peer (an activation for every forward
    that has a sender on another rank, a gradient for every backward that has one) and, given every
    rank's actions, the order to post its messages in."""
    cfg = chunks[0].cfg
    p2p = PipelineP2P(topo, tensor_shape(cfg, microbatches[0], topo), cfg.params_dtype)
    me, peers = topo.pp_rank, topo.ranks["pp"]
    counts = {}
    for a in actions:
        if a.recv_from is not None and a.recv_from != me and a.kind != WEIGHT_GRAD:
            channel = (peers[a.recv_from], _kind(a))
            counts[channel] = counts.get(channel, 0) + 1
    p2p.expect(counts)
    if every is not None:
        p2p.plan([(op, peers[peer], kind) for op, peer, kind in posting_order(every, me)])
    steps.p2p = p2p
    return p2p


def _finish(p2p, steps, topo, stats, chunks):
    p2p.finish()  # the last sends complete before the step goes on
    if stats is not None:
        stats.comm_seconds += p2p.comm_seconds
    total = steps.finish()
    return total if any(chunk.post_process for chunk in chunks) else None


def forward_backward_fill_drain(chunks, microbatches, forward_step, topo, forward_only=False, stats=None,
                                grad_sync=None):
    """GPipe: every forward, then every backward; stage 0 holds all m micro-batches (for comparison)."""
    (_,) = chunks
    return _run(chunks, microbatches, forward_step, topo, forward_only, stats, grad_sync, fill_drain=True)


_RUNNERS = {}


def pipelined(schedule=DEFAULT_SCHEDULE):
    """The runner of ``parallel.pp_schedule=schedule`` (one per schedule): this rank's action list from
    the schedule's record (actions.py), run by :func:`run_actions`."""
    if schedule not in _RUNNERS:
        def forward_backward(chunks, microbatches, forward_step, topo, forward_only=False, stats=None,
                             grad_sync=None):
            return _run(chunks, microbatches, forward_step, topo, forward_only, stats, grad_sync, schedule=schedule)

        forward_backward.__name__ = f"forward_backward_{schedule}"
        _RUNNERS[schedule] = forward_backward
    return _RUNNERS[schedule]


# 1F1B, interleaved over the chunks when a rank holds more than one: one runner under both names
forward_backward_pipelining_without_interleaving = forward_backward_pipelining_with_interleaving = pipelined()


def get_schedule(topo, fill_drain=False, schedule=DEFAULT_SCHEDULE):
    """The runner for this layout: no pipelining (pp=1), fill-drain (``fill_drain``), or the one
    ``schedule`` (``parallel.pp_schedule``) names, whose record refuses a layout it cannot run."""
    if topo.pp_size == 1:
        return forward_backward_no_pipelining
    if fill_drain:
        return forward_backward_fill_drain
    vpp = topo.vpp if (topo.vpp or 1) > 1 else None
    error = schedule_record(schedule).layout_error(topo.pp_size, vpp)
    if error:
        raise ValueError(error)
    return pipelined(schedule)
