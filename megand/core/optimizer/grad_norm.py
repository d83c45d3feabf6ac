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
    """
    device = grads[0].device if grads else topo.device
    acc = torch.zeros(2, dtype=torch.float32, device=device)  # [sum of squares, non-finite count]
    if counted:
        acc[0] = torch.stack([g.float().pow(2).sum() for g in counted]).sum()
    if grads:
        acc[1] = torch.stack([(~torch.isfinite(g)).sum() for g in grads]).sum().float()
    if sharded and topo.world_size > 1:
        dist.all_reduce(acc)  # every rank of the job: dp x cp x tp x pp
    elif not sharded and topo.tp_size * topo.pp_size > 1:
        dist.all_reduce(acc, group=topo.mp_group)
    return acc


def clip_grads(grads, grad_norm: float, max_norm: float) -> None:
    """Scale ``grads`` in place so that the global norm is at most ``max_norm`` (0: no clipping)."""
    if max_norm <= 0 or not grads:
        return
    coef = max_norm / (grad_norm + 1e-6)
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)
