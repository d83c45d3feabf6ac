"""Point-to-point communication between neighbouring pipeline stages.

Activations travel to the next stage, their gradients back to the previous one. Every message between
two stages has the same shape, known before the step starts: ``[s, b, h]`` with ``s`` the local
sequence (divided by tp under sequence parallelism: the sequence-sharded tensor is what crosses the
link, bsh/tp per link), so there is no shape handshake per micro-batch. All sends and receives of one
call are posted together with ``batch_isend_irecv`` (its receives then waited on), so a stage that sends
forward and receives backward at once (the steady state of 1F1B) cannot deadlock against its
neighbour doing the mirror call.

The pipeline wraps around (the last rank's next is the first rank): interleaved schedules pass the
last rank's chunk ``c`` output to the first rank's chunk ``c+1``. With pp=2 both neighbours are the
same rank, so one link carries activations and gradients in both directions; the two kinds are told
apart by tag (gloo), and every call posts forward-direction messages before backward-direction ones,
so the two ends of a link post them in the same order (what NCCL, which ignores tags, matches on).

Sends overlap compute: a call waits for its receives only; its sends stay in flight while the stage
computes, and are waited on at the start of the next call (or by :meth:`PipelineP2P.finish`). Once an
activation's send is complete its storage is released (it is needed again only as the root of its
backward, for which its shape suffices), so a stage does not hold the activations it sent until their
backward.

Receives overlap compute too: before each forward or backward the schedule calls
:meth:`PipelineP2P.prefetch`, which posts the receive of the next activation and of the next gradient
this stage will need (one ahead in each direction, up to the step's totals given by
:meth:`PipelineP2P.expect`); the call that needs the tensor then only waits for it. Each direction's
messages arrive in the order they are sent, and receives are posted, prefetched or not, in that same
order, so prefetching changes when a receive is posted, never which message it gets. Only where
messages are matched per tag (gloo): NCCL runs a communicator's p2p operations in the order they are
queued, and an early receive would hold back the sends queued behind it, so there every receive is
posted with the call that waits for it.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from megand.core.timing import device_timer

FORWARD_TAG, BACKWARD_TAG = 0, 1


def tensor_shape(cfg, microbatch, topo) -> tuple[int, int, int]:
    """The shape of what crosses a pipeline link for ``microbatch``: ``[s_local(/tp), b, h]``."""
    batch, seq = microbatch.batch_size, microbatch.positions.shape[-1]  # this rank's context-parallel share; positions may be per sample [b, s]
    if cfg.sequence_parallel:
        seq //= topo.tp_size
    return seq, batch, cfg.hidden_size


class PipelineP2P:
    """Sends and receives between this stage and its pipeline neighbours (global ranks, pp group).

    ``comm_seconds``: the time spent posting and waiting (the bubble tool reads it), measured by the
    device's timer (:mod:`megand.core.timing`: on CUDA, how long the compute stream waited).
    """

    def __init__(self, topo, shape, dtype):
        self.group, self.prev, self.next = topo.pp_group, topo.pp_prev_rank, topo.pp_next_rank
        self.shape, self.dtype, self.device = tuple(shape), dtype, topo.device
        self.timer = device_timer(self.device)
        self.tagged = dist.get_backend(self.group) != "nccl"  # NCCL does not take tags; it matches by order
        self._in_flight = []  # (request, the tensor being sent, the activation to release once sent, or None)
        self.prefetching = self.tagged
        # per direction: receives posted ahead of the call that needs them, oldest first (request, tensor);
        # how many receives this step still has to post; None: unknown (no prefetch)
        self._prefetched = {FORWARD_TAG: deque(), BACKWARD_TAG: deque()}
        self._to_post = {FORWARD_TAG: None, BACKWARD_TAG: None}

    def _op(self, op, tensor, peer, tag):
        return dist.P2POp(op, tensor, peer, self.group, tag if self.tagged else 0)

    def _empty(self):
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def expect(self, from_prev: int, from_next: int) -> None:
        """The receives of this step: ``from_prev`` activations and ``from_next`` gradients (what
        :meth:`prefetch` may post ahead; it never posts more)."""
        self._to_post = {FORWARD_TAG: from_prev, BACKWARD_TAG: from_next}

    def prefetch(self) -> None:
        """Post the receive of the next activation and of the next gradient this stage needs, unless
        already posted (called before each forward or backward, so they arrive during it)."""
        if not self.prefetching:
            return
        self.timer.start()
        for tag, peer in ((FORWARD_TAG, self.prev), (BACKWARD_TAG, self.next)):
            if not self._prefetched[tag] and self._to_post[tag]:
                tensor = self._empty()
                (request,) = dist.batch_isend_irecv([self._op(dist.irecv, tensor, peer, tag)])
                self._prefetched[tag].append((request, tensor))
                self._to_post[tag] -= 1
        self.timer.stop()

    @property
    def comm_seconds(self) -> float:
        return self.timer.seconds

    def _receive(self, tag, peer, ops, releases, waits):
        """The tensor of the next receive from ``peer``: the prefetched one (its request added to
        ``waits``), or a new one (its operation added to ``ops``)."""
        if self._prefetched[tag]:
            request, tensor = self._prefetched[tag].popleft()
            waits.append(request)
            return tensor
        tensor = self._empty()
        ops.append(self._op(dist.irecv, tensor, peer, tag))
        releases.append(None)
        if self._to_post[tag] is not None:
            self._to_post[tag] -= 1
        return tensor

    def communicate(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        """Post every given send and receive at once (a receive already posted by :meth:`prefetch` is
        taken instead); wait for the receives; return ``(from_prev, from_next)``. The sends complete
        while the caller computes (waited on by the next call)."""
        ops, releases, from_prev, from_next, waits = [], [], None, None, []
        # forward direction (activations) first, then backward direction (gradients)
        if send_next is not None:
            sent = self._checked(send_next)
            ops.append(self._op(dist.isend, sent, self.next, FORWARD_TAG))
            releases.append(send_next if send_next.is_contiguous() else None)  # sent shares its memory
        if recv_prev:
            from_prev = self._receive(FORWARD_TAG, self.prev, ops, releases, waits)
        if send_prev is not None:
            ops.append(self._op(dist.isend, self._checked(send_prev), self.prev, BACKWARD_TAG))
            releases.append(None)
        if recv_next:
            from_next = self._receive(BACKWARD_TAG, self.next, ops, releases, waits)
        self.timer.start()
        self.wait_sends()  # the previous call's sends ran while this stage computed
        if ops:
            requests = dist.batch_isend_irecv(ops)
            if len(requests) == len(ops):
                for op, request, release in zip(ops, requests, releases):
                    if op.op is dist.isend:
                        self._in_flight.append((request, op.tensor, release))
                    else:
                        request.wait()
            else:  # coalesced into one request (NCCL): wait for all of it
                for request in requests:
                    request.wait()
                for release in releases:
                    if release is not None:
                        release_storage(release)
        for request in waits:  # prefetched receives: waited only now, once this call's sends are posted
            request.wait()
        self.timer.stop()
        return from_prev, from_next

    def wait_sends(self) -> None:
        """Wait for the sends still in flight; release the storage of the activations they carried."""
        in_flight, self._in_flight = self._in_flight, []
        for request, _, release in in_flight:
            request.wait()
            if release is not None:
                release_storage(release)

    def finish(self) -> None:
        """At the end of a schedule: nothing may stay in flight."""
        self.timer.start()
        self.wait_sends()
        self.timer.stop()
        left = {tag: len(q) for tag, q in self._prefetched.items() if q}
        if left:  # a receive no call took would match a message of the next step
            raise RuntimeError(f"pipeline p2p: prefetched receives never taken (tag: count): {left}")

    def _checked(self, tensor):
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise RuntimeError(f"pipeline p2p: sending {tuple(tensor.shape)} {tensor.dtype}, the link carries "
                               f"{self.shape} {self.dtype}")
        return tensor.detach().contiguous()

    # Megatron's named calls; the receiving ones return the received tensor (None where nothing is received).
    def recv_forward(self, recv=True):
        return self.communicate(recv_prev=recv)[0]

    def send_forward(self, output):
        self.communicate(send_next=output)

    def recv_backward(self, recv=True):
        return self.communicate(recv_next=recv)[1]

    def send_backward(self, input_grad):
        self.communicate(send_prev=input_grad)

    def send_forward_recv_backward(self, output, recv=True):
        return self.communicate(send_next=output, recv_next=recv)[1]

    def send_backward_recv_forward(self, input_grad, recv=True):
        return self.communicate(send_prev=input_grad, recv_prev=recv)[0]

    def send_forward_recv_forward(self, output, recv=True):
        return self.communicate(send_next=output, recv_prev=recv)[0]

    def send_backward_recv_backward(self, input_grad, recv=True):
        return self.communicate(send_prev=input_grad, recv_next=recv)[1]

    def send_forward_backward_recv_forward_backward(self, output, input_grad, recv_prev, recv_next):
        return self.communicate(send_next=output, send_prev=input_grad, recv_prev=recv_prev, recv_next=recv_next)


# Ops whose backward saves neither their inputs nor their result: the storage of their output is never
# read again once sent. A stage's output is the residual add of its last layer. (The saved tensors of
# other ops are not inspected: under activation recomputation reading them would recompute the layer.)
_SAVES_NOTHING = frozenset({"AddBackward0"})


def release_storage(activation: torch.Tensor) -> None:
    """Free an activation's memory after its send, keeping its shape and autograd history: it is the
    root of its backward (``torch.autograd.backward(activation, grad)``), which reads only its shape.
    Only for an activation that owns its memory (not a view, whose memory other tensors share) produced
    by an op whose backward saves nothing; any other activation is kept whole."""
    fn = activation.grad_fn
    if activation._base is None and fn is not None and type(fn).__name__ in _SAVES_NOTHING:
        activation.untyped_storage().resize_(0)
