"""The global gradient norm, each element of the full model counted exactly once, and clipping."""

import torch
import torch.distributed as dist


def read_grad_stats(acc: torch.Tensor) -> tuple[float, bool]:
    """``(norm, found_inf)`` from :func:`grad_stats`'s tensor: the step's one read of device values."""
    norm = acc[0].sqrt().item()
    return norm, bool(acc[1].item() > 0) or not torch.isfinite(acc[0]).item()


def grad_stats(counted, grads, topo, sharded: bool) -> torch.Tensor:
    """``[global sum of squares, non-finite count]`` after its one all-reduce, as a tensor (nothing read).

    ``counted``: this rank's gradients that count in the norm (parameters with ``meta.counted_in_norm``:
    tp-sharded ones on every tp rank, replicated ones on tp rank 0, tied copies nowhere); ``grads``:
    all of this rank's gradients, checked for inf/nan. Without sharding, gradients are equal on the dp x cp
    replicas, so the model-parallel group (tp x pp) sums; with the distributed optimizer each rank holds
    a disjoint slice of every bucket, so the whole world sums (dp x cp x tp x pp). ``sharded`` asks for
    the world sum (also under expert parallelism, whose experts differ over ep: ``counted`` then holds
    each element on one rank only).

    One read of every gradient: a tensor's sum of squares is not finite exactly when one of its elements
    is not (or the sum overflows, which the step must skip too), so the per-tensor sums give both the norm
    and the non-finite count (of tensors, not elements). An elementwise ``isfinite`` mask, summed, would
    read every gradient twice more and widen a bool mask to int64: most of the cost of the pass.
    """
    device = grads[0].device if grads else topo.device
    acc = torch.zeros(2, dtype=torch.float32, device=device)  # [sum of squares, non-finite count]
    counted_ids = {id(g) for g in counted}
    sums = [_sums_of_squares(counted), _sums_of_squares([g for g in grads if id(g) not in counted_ids])]
    if counted:
        acc[0] = sums[0].sum()
    checked = [x for x in sums if x is not None]
    if checked:
        acc[1] = (~torch.isfinite(torch.cat(checked))).sum().float()
    if sharded and topo.world_size > 1:
        dist.all_reduce(acc)  # every rank of the job: dp x cp x tp x pp
    elif not sharded and topo.tp_size * topo.pp_size > 1:
        dist.all_reduce(acc, group=topo.mp_group)
    return acc


# Elements squared at a time: a bf16 gradient's fp32 piece is the only temporary (1 MiB), not a copy of the
# whole gradient (2.1 GB for a 128k-vocab embedding's), and it stays in cache
SQUARES_CHUNK = 1 << 18


def _sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    flat, squares = t.reshape(-1), []
    for piece in flat.split(SQUARES_CHUNK):
        piece = piece.float()
        squares.append(torch.dot(piece, piece))
    if len(squares) == 1:
        return squares[0]
    return torch.stack(squares).sum() if squares else flat.new_zeros((), dtype=torch.float32)


def _sums_of_squares(tensors):
    """Each tensor's sum of squares in fp32, stacked (None for no tensors), a piece at a time.

    Each piece's sum is one dot product (one read, no squares written): it accumulates in the kernel's vector
    lanes, each lane over 1/16 of the piece or less, ~1e-7 off in a 50M-parameter model's norm (``pow(2).sum()``,
    pairwise: ~1e-8, at twice the time on one CPU thread). ``torch._foreach_norm`` accumulates each tensor
    whole in few lanes, ~1e-5 off on a large embedding gradient: too far for the 1e-5 agreement of grad norms
    across layouts."""
    if not tensors:
        return None
    return torch.stack([_sum_of_squares(t) for t in tensors])


def clip_coefficient(grad_norm: float, max_norm: float) -> float | None:
    """The factor that brings the global norm down to ``max_norm``; None when no clipping is needed
    (``max_norm`` 0: never)."""
    if max_norm <= 0:
        return None
    coef = max_norm / (grad_norm + 1e-6)
    return coef if coef < 1.0 else None


def clip_grads(grads, grad_norm: float, max_norm: float) -> None:
    """Scale ``grads`` in place so that the global norm is at most ``max_norm`` (0: no clipping)."""
    coef = clip_coefficient(grad_norm, max_norm)
    if coef is not None and grads:
        torch._foreach_mul_(grads, coef)
