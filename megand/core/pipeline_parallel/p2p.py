"""Point-to-point communication between pipeline stages.

Activations travel to the next virtual stage, their gradients back to the previous one. Every message
between two stages has the same shape, known before the step starts: ``[s, b, h]`` with ``s`` the local
sequence (divided by tp under sequence parallelism: the sequence-sharded tensor is what crosses the
link, bsh/tp per link), so there is no shape handshake per micro-batch.

How messages are matched. Each kind of message (activations, gradients) and each direction (toward a
higher or a lower pipeline rank) has its own process group (``Topology.pp_channel_groups``), and no
tags are used: a message is the next one its group carries from that peer, in the order sent, which the
receiving end takes in the same order (every stage sends the activations and gradients of one kind in
its micro-batch order, and the next stage consumes them in that order). This is how NCCL, which
ignores tags, matches them, and gloo matches the same way, so every backend runs one path. On one group
for everything, NCCL would match a V placement's messages wrongly (zbv, dualpipev: chunk 0's activations
and chunk 1's gradients share a link, interleaved differently at its two ends) and, since it runs a
communicator's operations in the order they are queued, a receive could wait behind a send its peer
takes only later (a deadlock; interleaved 1F1B had it too once messages exceed NCCL's buffers). The
test of this module's schedules (tests/unit/test_pipeline_p2p_deadlock.py) replays what each rank
posts under those rules for every schedule.

The order of posting. Where the device runs one kernel at a time in the order queued
(``CUDA_DEVICE_MAX_CONNECTIONS=1``, common in Megatron recipes), communicators no longer run
independently: an unmatched send or receive holds everything posted after it on the rank, so two peers
posting the operations they share in opposite orders (stage s: an activation send then a gradient
receive; stage s+1: the gradient send then the activation receive, on other groups) wait for each other
for ever. Every rank therefore posts its messages in one global order (:func:`posting_order`, computed
by every rank from every rank's action list): a call posts what it asks for and, before it, every
receive the order puts earlier (taken by later calls).

Stages of different tensor-parallel widths (hand_off.py): a rank's pipeline peers are its sources in
each stage (``Topology.ranks["pp"]``); a send becomes consecutive sends to the receivers it serves, each
receiver takes its one message from its source, so the order above holds message by message.

The pipeline wraps around (the last rank's next is the first rank): interleaved schedules pass the
last rank's chunk ``c`` output to the first rank's chunk ``c+1``. A V placement (zbv, dualpipev) sends
each way on both links (chunk 0's activations and chunk 1's gradients to the next rank, chunk 1's
activations and chunk 0's gradients to the previous one).

Sends overlap compute and never make compute wait: a call waits for its receives only; its sends stay
in flight (their storage is released as they complete: an activation is needed again only as the root
of its backward, for which its shape suffices) and are all waited on by :meth:`PipelineP2P.finish`. A
send that waited for its receiver before the stage went on could deadlock two stages each sending to
the other.

Receives overlap compute too where the backend matches per operation (gloo): before each forward or
backward the schedule calls :meth:`PipelineP2P.prefetch`, which posts the receive of the next message of
every channel this stage still expects (up to the step's totals given by :meth:`PipelineP2P.expect`);
the call that needs the tensor then only waits for it. Receives are posted, prefetched or not, in each
channel's order, so prefetching changes when a receive is posted, never which message it gets. Not on
NCCL: an early receive would hold back the sends queued behind it on its communicator, so there every
receive is posted with the call that waits for it.
"""

from __future__ import annotations

from collections import defaultdict, deque

import torch
import torch.distributed as dist

from megand.core.timing import device_timer

ACTIVATION, GRADIENT = 0, 1  # the two kinds of message


def posting_order(every, rank) -> list:
    """The order in which pipeline rank ``rank`` posts its sends and receives, given every pipeline
    rank's action list (``every[r]``, megand/core/pipeline_parallel/actions.py): ``[(op, peer, kind)]``
    with op ``"send"`` or ``"recv"`` and peer a pipeline rank.

    Every rank posts its messages in one global order (the same for all ranks: by the time their
    sending action runs in an as-soon-as-possible replay of all the lists with unit durations, then
    by sender), so any two peers post the messages they share in the same order and no cycle of ranks
    can wait on each other: the earliest message not yet through is at the head of both its ends'
    queues. That holds on a device that runs one kernel at a time in the order queued
    (``CUDA_DEVICE_MAX_CONNECTIONS=1``), where a send or receive holds everything posted after it on
    the rank until its peer's matching one runs. The order never puts a send before the action that
    computes it: the time of a receive's message is below its action's, so every message earlier than
    an action's receive, or than its send, comes from an action already run (sends) or is a receive,
    which may be posted early."""
    from megand.core.pipeline_parallel.actions import FORWARD, WEIGHT_GRAD

    def kind(a):
        return ACTIVATION if a.kind == FORWARD else GRADIENT

    def received(a):  # the message an action takes from another rank: (kind, its stage, micro-batch)
        return (kind(a), a.stage, a.microbatch) if a.kind != WEIGHT_GRAD and a.recv_from not in (None, r) else None

    def sent(a):  # the message it sends to another rank
        if a.kind == WEIGHT_GRAD or a.send_to in (None, r):
            return None
        return kind(a), a.stage + 1 if a.kind == FORWARD else a.stage - 1, a.microbatch

    at = {}  # message -> (time of its sending action, sender)
    times = [[] for _ in every]  # per rank, each action's time
    progress = True
    while progress:
        progress = False
        for r, actions in enumerate(every):
            while len(times[r]) < len(actions):
                a = actions[len(times[r])]
                message = received(a)
                if message is not None and message not in at:
                    break
                start = max(times[r][-1] if times[r] else -1, at[message][0] if message is not None else -1)
                times[r].append(start + 1)
                if sent(a) is not None:
                    at[sent(a)] = (start + 1, r)
                progress = True
    if any(len(t) < len(actions) for t, actions in zip(times, every)):
        raise RuntimeError("pipeline p2p: the action lists wait on each other (no order runs them)")
    r, posts = rank, []
    for a in every[rank]:
        if received(a) is not None:
            posts.append((at[received(a)], "recv", a.recv_from, kind(a)))
        if sent(a) is not None:
            posts.append((at[sent(a)], "send", a.send_to, kind(a)))
    return [post[1:] for post in sorted(posts)]


def tensor_shape(cfg, microbatch, topo) -> tuple[int, int, int]:
    """The shape of what crosses a pipeline link for ``microbatch``: ``[s_local(/tp), b, w]``, ``w`` the hidden
    size and the per-layer inputs' width (:attr:`TransformerConfig.pipeline_width`)."""
    batch, seq = microbatch.batch_size, microbatch.positions.shape[-1]  # this rank's context-parallel share; positions may be per sample [b, s]
    if cfg.sequence_parallel:
        seq //= topo.tp_size
    return seq, batch, cfg.pipeline_width



class PipelineP2P:
    """Sends and receives between this stage and its pipeline peers (global ranks).

    A message travels on a channel: its peer and its kind (``ACTIVATION`` or ``GRADIENT``), in the
    group of its kind and direction; each channel's messages arrive in the order they are sent and are
    received in that order.

    ``comm_seconds``: the time spent posting and waiting (the bubble tool reads it), measured by the
    device's timer (:mod:`megand.core.timing`: on CUDA, how long the compute stream waited).
    """

    def __init__(self, topo, shape, dtype):
        self.prev, self.next = topo.pp_prev_rank, topo.pp_next_rank
        self.channel_groups = topo.pp_channel_groups
        self.pp_index = {rank: index for index, rank in enumerate(topo.ranks["pp"])}  # global -> pipeline rank
        self.me = topo.ranks["pp"][topo.pp_rank]
        # stages of different widths: each send goes to the receivers it serves (hand_off.py); None: one width
        self.hand_off = topo.stage_hand_off
        self.tp_group = topo.tp_group if self.hand_off is not None else None
        self.shape, self.dtype, self.device = tuple(shape), dtype, topo.device
        self.timer = device_timer(self.device)
        self._in_flight = []  # (request, the tensor being sent, the activation to release once sent, or None)
        # NCCL runs a communicator's operations in queue order: there an early receive would hold back sends
        self.prefetching = dist.get_backend(topo.pp_group) != "nccl"
        # per channel (peer, kind): receives posted ahead of the call that needs them, oldest first
        # (request, tensor); how many receives this step still has to post (absent: unknown, no prefetch)
        self._prefetched = defaultdict(deque)
        self._to_post = {}
        self._plan = None  # the posting order (see :meth:`plan`), or None: each call's batches in the groups' order

    def plan(self, order) -> None:
        """Post this step's sends and receives in ``order`` (:func:`posting_order`, peers as global
        ranks): each call posts, in that order, every operation up to the last it asks for (receives due
        earlier are posted then and taken by later calls)."""
        self._plan = list(order)
        self._next = 0
        self._indices = defaultdict(deque)  # (op, peer, kind) -> positions in the plan not yet posted
        for index, post in enumerate(self._plan):
            self._indices[post].append(index)
        self._outside = defaultdict(int)  # (peer, kind) -> receives posted by prefetch, ahead of the plan

    def group(self, sender, receiver, kind):
        """The group of a message of ``kind`` from ``sender`` to ``receiver`` (global ranks): one per kind
        and direction, so both ends name the same one."""
        lower = self.stage_of(receiver) < self.stage_of(sender)
        return self.channel_groups[2 * kind + lower]

    def stage_of(self, rank):
        """The pipeline rank of global rank ``rank`` (a peer, or a receiver a send of this rank serves)."""
        return self.pp_index[rank] if self.hand_off is None else self.hand_off.stage_of(rank)

    def _op(self, op, tensor, peer, kind):
        sender, receiver = (self.me, peer) if op is dist.isend else (peer, self.me)
        return dist.P2POp(op, tensor, peer, self.group(sender, receiver, kind))

    def _empty(self):
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def expect(self, from_prev: int | dict, from_next: int | None = None) -> None:
        """The receives of this step (what :meth:`prefetch` may post ahead; it never posts more): either
        ``from_prev`` activations and ``from_next`` gradients, or one dict ``{(peer, kind): count}``."""
        if isinstance(from_prev, dict):
            self._to_post = dict(from_prev)
        else:
            self._to_post = {(self.prev, ACTIVATION): from_prev, (self.next, GRADIENT): from_next}

    def prefetch(self) -> None:
        """Post the receive of the next message of every channel this stage still expects, unless already
        posted (called before each forward or backward, so they arrive during it)."""
        if not self.prefetching:
            return
        self.timer.start()
        for (peer, kind), left in self._to_post.items():
            if not self._prefetched[(peer, kind)] and left:
                tensor = self._empty()
                requests = dist.batch_isend_irecv([self._op(dist.irecv, tensor, peer, kind)])
                self._prefetched[(peer, kind)].append((requests, tensor))
                self._to_post[(peer, kind)] -= 1
                if self._plan is not None:
                    self._outside[(peer, kind)] += 1
        self.timer.stop()

    @property
    def comm_seconds(self) -> float:
        return self.timer.seconds

    def exchange(self, items):
        """Post every send and receive of ``items``: ``("send", tensor, peer, kind)`` or ``("recv", peer,
        kind)`` (a receive already posted, by :meth:`prefetch` or by an earlier call, is taken instead);
        wait for the receives; return the received tensors, in order. Under a :meth:`plan`, the
        operations go in its order, with every operation due before them (receives of later calls);
        else in the groups' order. Consecutive operations of one group go in one batch. The sends
        complete while the caller computes (an activation's storage is released once sent)."""
        sends, asked = defaultdict(deque), []  # per channel (peer, kind): the tensors to send; receives asked
        for item in items:
            if item[0] == "send":
                sends[item[2:]].append(item[1])
            else:
                asked.append(item[1:])
        ops = self._planned(sends, asked) if self._plan is not None else self._unplanned(sends, asked)
        self.timer.start()
        self._release_sent()
        batch = []
        for op in ops + [None]:
            if batch and (op is None or op[0].group is not batch[0][0].group):
                self._post(batch)
                batch = []
            batch.append(op)
        waits, received = [], []
        for channel in asked:
            requests, tensor = self._prefetched[channel].popleft()
            waits.extend(requests)
            received.append(tensor)
        for request in waits:
            request.wait()
        self._release_sent()
        self.timer.stop()
        return received

    def _send(self, tensor, peer, kind):
        """A send's operations (each with the activation to release once sent: an activation's memory is
        released once sent, as ``sent`` shares it when contiguous): one to ``peer``, or with stages of
        different widths one to each receiver this rank serves in ``peer``'s stage (hand_off.py)."""
        checked = self._checked(tensor)
        if self.hand_off is not None and not self.hand_off.direct(self.stage_of(peer)):
            return [(self._op(dist.isend, message, receiver, kind), None)
                    for receiver, message in self.hand_off.outgoing(checked, self.stage_of(peer), self.tp_group)]
        release = tensor if kind == ACTIVATION and tensor.is_contiguous() else None
        return [(self._op(dist.isend, checked, peer, kind), release)]

    def _recv(self, peer, kind):
        if self._to_post.get((peer, kind)) is not None:
            self._to_post[(peer, kind)] -= 1
        return self._op(dist.irecv, self._empty(), peer, kind), (peer, kind)

    def _unplanned(self, sends, asked):
        """The operations of one call without a plan: its sends, then the receives not yet posted, in
        the order of their groups (the same at every peer)."""
        ops = [op for channel, tensors in sends.items() for tensor in tensors for op in self._send(tensor, *channel)]
        for channel in dict.fromkeys(asked):
            ops += [self._recv(*channel) for _ in range(asked.count(channel) - len(self._prefetched[channel]))]
        return sorted(ops, key=lambda op: self.channel_groups.index(op[0].group))

    def _planned(self, sends, asked):
        """The operations of one call under the plan: every one up to the last it asks for, in order."""
        last = self._next - 1
        for channel, tensors in sends.items():
            due = self._indices[("send", *channel)]
            if len(due) < len(tensors):
                raise RuntimeError(f"pipeline p2p: a send to {channel} the step's order does not hold")
            last = max(last, due[len(tensors) - 1])
        for channel in dict.fromkeys(asked):
            missing = asked.count(channel) - len(self._prefetched[channel])
            if missing > 0:
                due, k = self._indices[("recv", *channel)], self._outside[channel] + missing
                if len(due) < k:
                    raise RuntimeError(f"pipeline p2p: a receive from {channel} the step's order does not hold")
                last = max(last, due[k - 1])
        ops = []
        while self._next <= last:
            post = self._plan[self._next]
            self._next += 1
            self._indices[post].popleft()
            op, channel = post[0], post[1:]
            if op == "send":
                if not sends[channel]:
                    raise RuntimeError(f"pipeline p2p: a send to {channel} is due before it is computed")
                ops.extend(self._send(sends[channel].popleft(), *channel))
            elif self._outside[channel]:  # posted already by prefetch
                self._outside[channel] -= 1
            else:
                ops.append(self._recv(*channel))
        return ops

    def _post(self, batch):
        """Post one batch (operations of one group): its sends stay in flight, its receives are queued
        per channel for the calls that take them."""
        requests = dist.batch_isend_irecv([op for op, _ in batch])
        if len(requests) != len(batch):  # coalesced into one request (NCCL): each operation has them all
            requests = [requests] * len(batch)
        else:
            requests = [[request] for request in requests]
        for (op, extra), request in zip(batch, requests):
            if op.op is dist.isend:
                self._in_flight.extend((r, op.tensor, extra) for r in request)
            else:
                self._prefetched[extra].append((request, op.tensor))

    def communicate(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        """Neighbour exchange: every given send and receive at once; return ``(from_prev, from_next)``."""
        items = []
        if send_next is not None:
            items.append(("send", send_next, self.next, ACTIVATION))
        if recv_prev:
            items.append(("recv", self.prev, ACTIVATION))
        if send_prev is not None:
            items.append(("send", send_prev, self.prev, GRADIENT))
        if recv_next:
            items.append(("recv", self.next, GRADIENT))
        received = iter(self.exchange(items))
        from_prev = next(received) if recv_prev else None
        from_next = next(received) if recv_next else None
        return from_prev, from_next

    def _release_sent(self) -> None:
        """Forget the sends already complete (without waiting for the others); release the storage of the
        activations they carried."""
        still = []
        for request, tensor, release in self._in_flight:
            if request.is_completed():
                request.wait()  # returns at once: the request's bookkeeping (and on CUDA an already-met event)
                if release is not None:
                    release_storage(release)
            else:
                still.append((request, tensor, release))
        self._in_flight = still

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
        left = {channel: len(q) for channel, q in self._prefetched.items() if q}
        if left:  # a receive no call took would match a message of the next step
            raise RuntimeError(f"pipeline p2p: receives never taken ((peer, kind): count): {left}")

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
