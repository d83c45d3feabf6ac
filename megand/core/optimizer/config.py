"""The optimizer's own configuration (built from the run config by the training package)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adamw"  # a registered optimizer (registry.py): adamw | muon | lion
    muon_momentum: float = 0.95  # Muon's momentum coefficient
    muon_nesterov: bool = True  # Nesterov momentum for Muon
    muon_ns_steps: int = 5  # Newton-Schulz iterations
    lr: float = 3.0e-4  # peak learning rate
    min_lr: float = 3.0e-5  # learning rate at the end of the decay
    warmup_iters: int = 10  # linear warm-up steps
    decay_iters: int = 100  # steps from the start to the end of the decay
    schedule: str = "cosine"  # cosine | linear | constant | wsd (warmup-stable-decay)
    decay_style: str = "1-sqrt"  # wsd: shape of the decay, linear | cosine | 1-sqrt
    decay_fraction: float = 0.2  # wsd: the last decay_fraction x decay_iters steps decay (unless decay_start)
    decay_start: int | None = None  # wsd: the step after which the decay starts (a cooldown from a stable checkpoint)
    weight_decay: float = 0.1  # AdamW decay on matrices (not on biases and norms)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1.0e-8
    clip_grad: float = 1.0  # 0: no clipping
    initial_loss_scale: float = 65536.0  # fp16 dynamic loss scale at start
    loss_scale_window: int = 1000  # fp16: steps without overflow before the scale doubles
    hysteresis: int = 2  # fp16: overflows tolerated before the scale halves
    min_loss_scale: float = 1.0  # fp16: the scale never goes below this
