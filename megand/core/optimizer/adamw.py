"""AdamW over the pieces: torch's functional AdamW (fused on CUDA and CPU: one pass over parameter,
gradient and moments instead of a foreach kernel per term, about 3x faster on CPU; foreach elsewhere;
apex's FusedAdam when installed on CUDA) on the piece views. It takes every parameter role, and is the
fallback of optimizers that take only some (Muon)."""

from __future__ import annotations

import torch
from torch.optim.adamw import adamw as functional_adamw

from megand.core.optimizer.checks import in_unit_interval, require
from megand.core.optimizer.grad_norm import clip_coefficient, clip_grads
from megand.core.optimizer.record import OptimizerRecord
from megand.core.sharding import ROLES

try:  # optional: apex's multi-tensor Adam (CUDA only); torch's fused AdamW is used otherwise
    from apex.optimizers import FusedAdam as ApexFusedAdam
except Exception:  # noqa: BLE001 - any import problem means "not available"
    ApexFusedAdam = None

# torch's fused AdamW kernel: elementwise, so its result does not depend on how the state is cut into pieces
FUSED_ADAMW_DEVICES = ("cuda", "cpu")


class AdamWUpdate:
    def __init__(self, named_params, pieces, cfg, ddp, topo):
        self.pieces, self.cfg = pieces, cfg
        device = topo.device
        self.use_apex = ApexFusedAdam is not None and device.type == "cuda" and bool(pieces)
        self.fused = device.type in FUSED_ADAMW_DEVICES and not self.use_apex
        if self.use_apex:
            self._apex = self._make_apex()

    def step(self, lr: float, grad_norm: float) -> None:
        if self.fused:  # the fused kernel clips as it reads each gradient (its grad_scale divides): no extra pass
            self._adamw(lr, clip_coefficient(grad_norm, self.cfg.clip_grad))
        else:
            clip_grads([x.grad for x in self.pieces], grad_norm, self.cfg.clip_grad)
            self._adamw(lr)

    def _adamw(self, lr, clip: float | None = None):
        """``clip``: the fused kernel's factor on the gradients (the others are clipped before)."""
        c = self.cfg
        for decay in (True, False):
            group = [x for x in self.pieces if x.decay == decay]
            if not group:
                continue
            wd = c.weight_decay if decay else 0.0
            if self.use_apex:
                self._apex.param_groups[0 if decay else 1]["lr"] = lr
                continue
            grad_scale = None if clip is None else torch.full((), 1.0 / clip, dtype=torch.float32,
                                                              device=group[0].grad.device)
            functional_adamw([x.main for x in group], [x.grad for x in group], [x.state["exp_avg"] for x in group],
                             [x.state["exp_avg_sq"] for x in group], [], [x.step for x in group],
                             foreach=not self.fused, fused=self.fused or None, grad_scale=grad_scale, amsgrad=False,
                             beta1=c.beta1, beta2=c.beta2, lr=lr, weight_decay=wd, eps=c.eps, maximize=False)
        if self.use_apex:
            for x in self.pieces:
                x.main.grad = x.grad
            self._apex.step()
            for x in self.pieces:
                x.main.grad = None

    def _make_apex(self):
        """apex FusedAdam (adam_w_mode) over the piece views, its state pointed at our flat moments."""
        c = self.cfg
        groups = [{"params": [x.main for x in self.pieces if x.decay == d], "weight_decay": c.weight_decay if d else 0.0}
                  for d in (True, False)]
        opt = ApexFusedAdam(groups, lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps, adam_w_mode=True)
        for x in self.pieces:
            opt.state[x.main] = {"exp_avg": x.state["exp_avg"], "exp_avg_sq": x.state["exp_avg_sq"]}
        return opt

    def set_step(self, steps: int) -> None:
        for x in self.pieces:
            x.step.fill_(steps)
        if self.use_apex:
            for group in self._apex.param_groups:
                group["step"] = steps


# 36 bytes per element: read the fp32 grad, param, m, v; write param, m, v; the model copy; the grad norm's read
def check_adamw(o) -> None:
    in_unit_interval(o, "beta1")
    in_unit_interval(o, "beta2")
    require(o.eps > 0, f"optim.eps={o.eps} must be > 0")


ADAMW = OptimizerRecord(name="adamw", state=("exp_avg", "exp_avg_sq"), roles=frozenset(ROLES), update=AdamWUpdate,
                        update_bytes=36, check=check_adamw)
