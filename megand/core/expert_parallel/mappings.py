"""The expert-parallel collective as an autograd function: an all-to-all with variable splits.

``all_to_all_single`` with explicit input/output split sizes runs on gloo and nccl alike. Its backward is
the same exchange in reverse: the gradient of what rank j received from rank i goes back from j to i.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def exchange(x: torch.Tensor, group, send: list[int], recv: list[int]) -> torch.Tensor:
    """Send rows ``x[sum(send[:j]) : sum(send[:j+1])]`` to rank j of ``group``; receive ``recv[j]`` rows
    from rank j, concatenated in rank order."""
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, send, recv, on_bytes):
        ctx.group, ctx.send, ctx.recv, ctx.on_bytes = group, send, recv, on_bytes
        return exchange(x, group, send, recv)

    @staticmethod
    def backward(ctx, grad):
        if ctx.on_bytes is not None:
            ctx.on_bytes(grad, ctx.recv)
        return exchange(grad, ctx.group, ctx.recv, ctx.send), None, None, None, None


def all_to_all(x: torch.Tensor, group, send: list[int], recv: list[int], on_bytes=None) -> torch.Tensor:
    """The all-to-all of :func:`exchange`, differentiable. ``on_bytes(tensor, splits)``, if given, is
    called with what is sent in each direction (forward, then backward) so callers can count traffic."""
    if on_bytes is not None:
        on_bytes(x, send)
    return _AllToAll.apply(x, group, list(send), list(recv), on_bytes)
