"""Point-to-point communication between neighbouring pipeline stages.

Activations travel to the next stage, their gradients back to the previous one. Every message between
two stages has the same shape, known before the step starts: ``[s, b, h]`` with ``s`` the local
sequence (divided by tp under sequence parallelism: the sequence-sharded tensor is what crosses the
link, bsh/tp per link), so there is no shape handshake per micro-batch. All sends and receives of one
call are posted together with ``batch_isend_irecv`` (its receives then waited on), so a stage that sends
forward and receives backward at once (the steady state of 1F1B) cannot deadlock against its
neighbour doing the mirror call.

The pipeline wraps around (the last rank's next is the first rank): interleaved schedules pass the
last rank's chunk ``c`` output to the first rank's chunk ``c+1``. A V placement (zbv, dualpipev) sends
each way on both links: chunk 0's activations and chunk 1's gradients to the next rank, chunk 1's
activations and chunk 0's gradients to the previous one (:meth:`PipelineP2P.exchange` names each
message's peer and tag). With pp=2 both neighbours are the
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

from collections import defaultdict, deque

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
    """Sends and receives between this stage and its pipeline peers (global ranks, pp group).

    A message travels on a channel: its peer and its tag (``FORWARD_TAG`` for activations,
    ``BACKWARD_TAG`` for gradients). Each channel's messages arrive in the order they are sent and are
    received in that order. Where the backend ignores tags (NCCL), a peer's messages of both kinds are
    matched in the order that peer sends them: given that order (:meth:`expect`), a receive first takes
    the peer's earlier messages of the other kind, kept for the call that needs them.

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
        # per channel (peer, tag): receives posted ahead of the call that needs them, oldest first
        # (request, tensor); how many receives this step still has to post (absent: unknown, no prefetch)
        self._prefetched = defaultdict(deque)
        self._to_post = {}
        self._sender_order = {}  # untagged: peer -> the tags of its messages to this rank, in its send order
        self._early = defaultdict(deque)  # untagged: (peer, tag) -> tensors received ahead of their call

    def _op(self, op, tensor, peer, tag):
        return dist.P2POp(op, tensor, peer, self.group, tag if self.tagged else 0)

    def _empty(self):
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def expect(self, from_prev: int | dict, from_next: int | None = None, sender_order: dict | None = None) -> None:
        """The receives of this step (what :meth:`prefetch` may post ahead; it never posts more): either
        ``from_prev`` activations and ``from_next`` gradients, or one dict ``{(peer, tag): count}``.
        ``sender_order``: ``{peer: [tag, ...]}``, the kinds of the messages each peer sends this rank in
        the order it sends them (needed where the backend ignores tags and a peer sends both kinds in
        another order than this rank takes them)."""
        if isinstance(from_prev, dict):
            self._to_post = dict(from_prev)
        else:
            self._to_post = {(self.prev, FORWARD_TAG): from_prev, (self.next, BACKWARD_TAG): from_next}
        self._sender_order = {peer: deque(tags) for peer, tags in (sender_order or {}).items()}

    def prefetch(self) -> None:
        """Post the receive of the next message of every channel this stage still expects, unless already
        posted (called before each forward or backward, so they arrive during it)."""
        if not self.prefetching:
            return
        self.timer.start()
        for (peer, tag), left in self._to_post.items():
            if not self._prefetched[(peer, tag)] and left:
                tensor = self._empty()
                (request,) = dist.batch_isend_irecv([self._op(dist.irecv, tensor, peer, tag)])
                self._prefetched[(peer, tag)].append((request, tensor))
                self._to_post[(peer, tag)] -= 1
        self.timer.stop()

    @property
    def comm_seconds(self) -> float:
        return self.timer.seconds

    def _post_receive(self, tag, peer, ops, releases):
        tensor = self._empty()
        ops.append(self._op(dist.irecv, tensor, peer, tag))
        releases.append(None)
        if self._to_post.get((peer, tag)) is not None:
            self._to_post[(peer, tag)] -= 1
        return tensor

    def _receive(self, tag, peer, ops, releases, waits):
        """The tensor of the next receive from ``peer`` on ``tag``: one received ahead, the prefetched one
        (its request added to ``waits``), or a new one (its operation added to ``ops``, after the peer's
        earlier messages of the other kind where the backend matches by order)."""
        channel = (peer, tag)
        if self._early[channel]:
            return self._early[channel].popleft()
        if self._prefetched[channel]:
            request, tensor = self._prefetched[channel].popleft()
            waits.append(request)
            return tensor
        order = self._sender_order.get(peer)
        if order is not None:
            while order and order[0] != tag:  # the peer sent these first: they are matched first
                self._early[(peer, order[0])].append(self._post_receive(order[0], peer, ops, releases))
                order.popleft()
            if order:
                order.popleft()
        return self._post_receive(tag, peer, ops, releases)

    def exchange(self, items):
        """Post every send and receive of ``items`` at once, in their order: ``("send", tensor, peer, tag)``
        or ``("recv", peer, tag)`` (a receive already posted by :meth:`prefetch` is taken instead); wait
        for the receives; return the received tensors, in order. The sends complete while the caller
        computes (waited on by the next call); an activation's storage is released once sent."""
        ops, releases, waits, received = [], [], [], []
        for item in items:
            if item[0] == "send":
                _, tensor, peer, tag = item
                ops.append(self._op(dist.isend, self._checked(tensor), peer, tag))
                # an activation's memory: released once sent (``sent`` shares it when contiguous)
                releases.append(tensor if tag == FORWARD_TAG and tensor.is_contiguous() else None)
            else:
                _, peer, tag = item
                received.append(self._receive(tag, peer, ops, releases, waits))
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
        return received

    def communicate(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        """Neighbour exchange: every given send and receive at once, forward direction (activations)
        first, then backward direction (gradients); return ``(from_prev, from_next)``."""
        items = []
        if send_next is not None:
            items.append(("send", send_next, self.next, FORWARD_TAG))
        if recv_prev:
            items.append(("recv", self.prev, FORWARD_TAG))
        if send_prev is not None:
            items.append(("send", send_prev, self.prev, BACKWARD_TAG))
        if recv_next:
            items.append(("recv", self.next, BACKWARD_TAG))
        received = iter(self.exchange(items))
        from_prev = next(received) if recv_prev else None
        from_next = next(received) if recv_next else None
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
        left = {channel: len(q) for channel, q in [*self._prefetched.items(), *self._early.items()] if q}
        if left:  # a receive no call took would match a message of the next step
            raise RuntimeError(f"pipeline p2p: receives never taken ((peer, tag): count): {left}")

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
