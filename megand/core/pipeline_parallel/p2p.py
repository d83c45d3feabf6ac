"""Point-to-point communication between neighbouring pipeline stages.

Activations travel to the next stage, their gradients back to the previous one. Every message between
two stages has the same shape, known before the step starts: ``[s, b, h]`` with ``s`` the local
sequence (divided by tp under sequence parallelism: the sequence-sharded tensor is what crosses the
link, bsh/tp per link), so there is no shape handshake per micro-batch. All sends and receives of one
call are posted together with ``batch_isend_irecv`` and waited on together, so a stage that sends
forward and receives backward at once (the steady state of 1F1B) cannot deadlock against its
neighbour doing the mirror call.

The pipeline wraps around (the last rank's next is the first rank): interleaved schedules pass the
last rank's chunk ``c`` output to the first rank's chunk ``c+1``. With pp=2 both neighbours are the
same rank, so one link carries activations and gradients in both directions; the two kinds are told
apart by tag (gloo), and every call posts forward-direction messages before backward-direction ones,
so the two ends of a link post them in the same order (what NCCL, which ignores tags, matches on).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

FORWARD_TAG, BACKWARD_TAG = 0, 1


def tensor_shape(cfg, microbatch, topo) -> tuple[int, int, int]:
    """The shape of what crosses a pipeline link for ``microbatch``: ``[s_local(/tp), b, h]``."""
    batch, seq = microbatch.batch_size, microbatch.positions.shape[-1]  # this rank's context-parallel share; positions may be per sample [b, s]
    if cfg.sequence_parallel:
        seq //= topo.tp_size
    return seq, batch, cfg.hidden_size


class PipelineP2P:
    """Sends and receives between this stage and its pipeline neighbours (global ranks, pp group).

    ``comm_seconds`` accumulates the wall time spent posting and waiting (the bubble tool reads it).
    """

    def __init__(self, topo, shape, dtype):
        self.group, self.prev, self.next = topo.pp_group, topo.pp_prev_rank, topo.pp_next_rank
        self.shape, self.dtype, self.device = tuple(shape), dtype, topo.device
        self.comm_seconds = 0.0
        self.tagged = dist.get_backend(self.group) != "nccl"  # NCCL does not take tags; it matches by order

    def _op(self, op, tensor, peer, tag):
        return dist.P2POp(op, tensor, peer, self.group, tag if self.tagged else 0)

    def _empty(self):
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def communicate(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        """Post every given send and receive at once; return ``(from_prev, from_next)`` received tensors."""
        ops, from_prev, from_next = [], None, None
        # forward direction (activations) first, then backward direction (gradients)
        if send_next is not None:
            ops.append(self._op(dist.isend, self._checked(send_next), self.next, FORWARD_TAG))
        if recv_prev:
            from_prev = self._empty()
            ops.append(self._op(dist.irecv, from_prev, self.prev, FORWARD_TAG))
        if send_prev is not None:
            ops.append(self._op(dist.isend, self._checked(send_prev), self.prev, BACKWARD_TAG))
        if recv_next:
            from_next = self._empty()
            ops.append(self._op(dist.irecv, from_next, self.next, BACKWARD_TAG))
        if ops:
            start = time.perf_counter()
            for request in dist.batch_isend_irecv(ops):
                request.wait()
            self.comm_seconds += time.perf_counter() - start
        return from_prev, from_next

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
