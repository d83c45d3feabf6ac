"""The global gradient norm, each element of the full model counted exactly once."""

import torch
import torch.distributed as dist


def global_grad_norm(params, topo) -> torch.Tensor:
    """L2 norm over every parameter of every stage, after the gradient reductions.

    Gradients are then equal on dp and cp replicas, so only the model-parallel group (tp x pp) sums:
    tp-sharded parameters count on every tp rank, replicated ones on tp rank 0 only, and a tied copy
    (``copy_of``) not at all. A nan/inf anywhere makes the norm nan/inf on every rank.
    """
    counted = [p.grad for p in params if p.grad is not None and p.meta.counted_in_norm]
    device = counted[0].device if counted else topo.device
    sum_sq = torch.zeros((), dtype=torch.float32, device=device)
    if counted:
        sum_sq = torch.stack([g.float().pow(2).sum() for g in counted]).sum()
    if topo.tp_size * topo.pp_size > 1:
        dist.all_reduce(sum_sq, group=topo.mp_group)
    return sum_sq.sqrt()


def clip_grads(params, grad_norm: torch.Tensor, max_norm: float) -> None:
    if max_norm <= 0:
        return
    coef = max_norm / (grad_norm + 1e-6)
    if coef < 1.0:
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, coef.to(grads[0].dtype) if grads else coef)
