"""AdamW over this rank's parameters, with the global grad norm and clipping."""

from dataclasses import dataclass

import torch

from megand.core.optimizer.grad_norm import clip_grads, global_grad_norm
from megand.core.optimizer.lr_schedule import LRSchedule


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool
    lr: float
    loss_scale: float = 1.0


def param_groups(params, weight_decay):
    """Weight decay on matrices only; biases and norm weights are not decayed."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class Optimizer:
    """``named_params``: ``(name, param)`` pairs with the full model's names (used by checkpoints)."""

    def __init__(self, named_params, optim_cfg, train_iters, topo):
        self.named_params = [(n, p) for n, p in named_params if p.requires_grad]
        self.params = [p for _, p in self.named_params]
        self.topo, self.clip_grad = topo, optim_cfg.clip_grad
        self.schedule = LRSchedule(optim_cfg.lr, optim_cfg.min_lr, optim_cfg.warmup_iters,
                                   optim_cfg.decay_iters or train_iters, optim_cfg.schedule)
        self.adam = torch.optim.AdamW(param_groups(self.params, optim_cfg.weight_decay), lr=optim_cfg.lr,
                                      betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps, foreach=True)
        self.steps = 0

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self) -> StepResult:
        grad_norm = global_grad_norm(self.params, self.topo)
        lr = self.schedule(self.steps + 1)
        if not torch.isfinite(grad_norm):  # every rank sees the same norm, so all skip together
            return StepResult(grad_norm.item(), True, lr)
        clip_grads(self.params, grad_norm, self.clip_grad)
        for group in self.adam.param_groups:
            group["lr"] = lr
        self.adam.step()
        self.steps += 1
        return StepResult(grad_norm.item(), False, lr)

    # Checkpoint interface (megand.core.checkpointing): per-parameter states with this rank's LOCAL
    # tensor-parallel shard shapes (same shape as the parameter), and the scalars.
    STATE_KEYS = ("exp_avg", "exp_avg_sq")

    def state_dict_per_param(self) -> dict[str, dict[str, torch.Tensor]]:
        out = {}
        for name, p in self.named_params:
            state = self.adam.state.get(p, {})
            out[name] = {k: state[k] if k in state else torch.zeros_like(p) for k in self.STATE_KEYS}
        return out

    @torch.no_grad()
    def load_state_dict_per_param(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        """``states[name]`` holds ``exp_avg`` and ``exp_avg_sq`` (a ``main`` entry is ignored: fp32 params
        are their own master copy)."""
        for name, p in self.named_params:
            given = states[name]
            self.adam.state[p] = {"step": self._step_tensor(),
                                  **{k: given[k].to(p.device, p.dtype).clone() for k in self.STATE_KEYS}}

    def _step_tensor(self):
        return torch.tensor(float(self.steps), dtype=torch.float32)

    def scalar_state(self) -> dict:
        return {"steps": self.steps}

    def load_scalar_state(self, d: dict) -> None:
        self.steps = int(d["steps"])
        for state in self.adam.state.values():
            if "step" in state:
                state["step"] = self._step_tensor()
