"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): the sign of an interpolation of
the momentum and the gradient, one fp32 moment per element. Per element, with gradient ``g`` (after
clipping), moment ``m``, ``beta1`` / ``beta2`` / ``weight_decay`` / ``lr`` from ``optim.*``::

    c = beta1 m + (1 - beta1) g
    p <- p - lr (sign(c) + wd p)          (the decay only where the parameter decays: not norms, biases)
    m <- beta2 m + (1 - beta2) g

Elementwise, so each rank updates its pieces where they are, whatever the layout. It takes every role.
Its update has the size ``lr`` on every element: Lion's usual learning rate is 3-10x below AdamW's, its
weight decay as many times higher.
"""

from __future__ import annotations

from megand.core.optimizer.checks import in_unit_interval
from megand.core.optimizer.grad_norm import clip_grads
from megand.core.optimizer.record import OptimizerRecord
from megand.core.sharding import ROLES


class LionUpdate:
    def __init__(self, named_params, pieces, cfg, ddp, topo):
        self.pieces, self.cfg = pieces, cfg

    def step(self, lr: float, grad_norm: float) -> None:
        c = self.cfg
        clip_grads([x.grad for x in self.pieces], grad_norm, c.clip_grad)
        decay = 1.0 - lr * c.weight_decay
        for x in self.pieces:  # piece by piece: the one temporary (c) is at most a piece
            m, g = x.state["lion_momentum"], x.grad
            if x.decay and c.weight_decay:
                x.main.mul_(decay)
            x.main.add_(m.mul(c.beta1).add_(g, alpha=1.0 - c.beta1).sign_(), alpha=-lr)
            m.mul_(c.beta2).add_(g, alpha=1.0 - c.beta2)

    def set_step(self, steps: int) -> None:
        pass


# 28 bytes per element: read the fp32 grad, param, m; write param, m; the model copy; the grad norm's read
def check_lion(o) -> None:
    in_unit_interval(o, "beta1", closed_high=True)  # 1: the sign of the momentum alone
    in_unit_interval(o, "beta2")


LION = OptimizerRecord(name="lion", state=("lion_momentum",), roles=frozenset(ROLES), update=LionUpdate,
                       update_bytes=28, check=check_lion)
