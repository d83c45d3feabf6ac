"""Context parallelism for a recurrent layer: each cp rank continues the state of the tokens before its own.

The load-balanced split (:mod:`megand.core.context_parallel.sequence`) gives cp rank r chunks r and 2cp-1-r
of 2cp. A recurrent layer reads its sequence in order, so the state walks up the ranks through the first
halves and back down through the second halves::

    chunk:  0 -> 1 -> ... -> cp-1 -> cp -> cp+1 -> ... -> 2cp-1
    rank:   0 -> 1 -> ... -> cp-1 -> cp-1 -> cp-2 -> ... -> 0

Forward: rank r receives the state of chunk r-1 from rank r-1, runs its first chunk, sends the state on to
rank r+1, receives the state of chunk 2cp-2-r back from it, runs its second chunk and sends that state to
rank r-1. Backward walks the same path reversed, passing the state's gradient back (each chunk recomputed
with autograd from the states saved in forward). The walk is sequential: its cost is the cp-fold latency of
the layer's chunked form, and its traffic is one state per chunk boundary.

``step(x, state, args)`` runs one chunk: it returns its output and the state after it; ``state`` is a tuple of
tensors (the layer's recurrent state and whatever else crosses a chunk boundary).
"""

import torch
import torch.distributed as dist


def _send(tensors, group, peer):
    for t in tensors:
        dist.send(t.contiguous(), group=group, group_dst=peer)


def _recv(like, group, peer):
    out = tuple(torch.empty_like(t) for t in like)
    for t in out:
        dist.recv(t, group=group, group_src=peer)
    return out


class StatePassing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, step, chunk_args, zero_state, group, x, *params):
        """``x``: this rank's two chunks, concatenated along dim 1 (``[b, s_local, ...]``); ``params``: the
        tensors ``step`` reads besides ``x`` and the state (their gradients are returned); ``chunk_args``: the
        per-chunk non-tensor arguments (first chunk, second chunk); ``zero_state``: the state before token 0."""
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        first, second = x.chunk(2, dim=1)
        with torch.no_grad():
            state0 = _recv(zero_state, group, rank - 1) if rank > 0 else zero_state
            out1, state1 = step(first, state0, params, chunk_args[0])
            if rank < size - 1:
                _send(state1, group, rank + 1)
                state2 = _recv(zero_state, group, rank + 1)
            else:
                state2 = state1
            out2, state3 = step(second, state2, params, chunk_args[1])
            if rank > 0:
                _send(state3, group, rank - 1)
        ctx.step, ctx.chunk_args, ctx.group, ctx.n_state = step, chunk_args, group, len(zero_state)
        ctx.save_for_backward(first, second, *state0, *state2, *params)
        return torch.cat([out1, out2], dim=1)

    @staticmethod
    def backward(ctx, grad):
        group, n = ctx.group, ctx.n_state
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        first, second, *rest = ctx.saved_tensors
        state0, state2, params = tuple(rest[:n]), tuple(rest[n:2 * n]), rest[2 * n:]
        grad1, grad2 = grad.chunk(2, dim=1)

        def backward_chunk(x, state, grad_out, grad_state, args):
            """Gradients of one chunk's input, incoming state and params, from its output's and final
            state's gradients (recomputed with autograd)."""
            with torch.enable_grad():
                x = x.detach().requires_grad_()
                state = tuple(s.detach().requires_grad_() for s in state)
                ps = tuple(p.detach().requires_grad_(p.requires_grad) for p in params)
                out, final = step(x, state, ps, args)
                inputs = (x, *state, *[p for p in ps if p.requires_grad])
                grads = torch.autograd.grad((out, *final), inputs, (grad_out, *grad_state), allow_unused=True)
            grads = [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads)]
            return grads[0], tuple(grads[1:1 + n]), grads[1 + n:]

        step = ctx.step
        zeros = tuple(torch.zeros_like(s) for s in state0)
        grad_state3 = _recv(zeros, group, rank - 1) if rank > 0 else zeros
        gx2, grad_state2, gp2 = backward_chunk(second, state2, grad2.contiguous(), grad_state3, ctx.chunk_args[1])
        if rank < size - 1:
            _send(grad_state2, group, rank + 1)
            grad_state1 = _recv(zeros, group, rank + 1)
        else:
            grad_state1 = grad_state2
        gx1, grad_state0, gp1 = backward_chunk(first, state0, grad1.contiguous(), grad_state1, ctx.chunk_args[0])
        if rank > 0:
            _send(grad_state0, group, rank - 1)
        it = iter(a + b for a, b in zip(gp1, gp2))
        grad_params = [next(it) if p.requires_grad else None for p in params]
        return (None, None, None, None, torch.cat([gx1, gx2], dim=1), *grad_params)


def pass_state(step, x, params, zero_state, chunk_args, group):
    """``step`` over this rank's two load-balanced chunks of ``x``, continuing the state across the cp ranks
    of ``group`` (see the module's docstring); differentiable in ``x`` and ``params``."""
    return StatePassing.apply(step, chunk_args, tuple(zero_state), group, x, *params)
