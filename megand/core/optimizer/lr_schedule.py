"""Learning-rate schedules: linear warm-up, then cosine, linear or constant decay to ``min_lr``."""

import math


class LRSchedule:
    def __init__(self, lr, min_lr, warmup_iters, decay_iters, kind="cosine"):
        self.lr, self.min_lr, self.warmup_iters, self.decay_iters, self.kind = lr, min_lr, warmup_iters, decay_iters, kind

    def __call__(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (1-based)."""
        if self.warmup_iters and step <= self.warmup_iters:
            return self.lr * step / self.warmup_iters
        if self.kind == "constant":
            return self.lr
        span = max(1, self.decay_iters - self.warmup_iters)
        progress = min(1.0, (step - self.warmup_iters) / span)
        if self.kind == "linear":
            factor = 1.0 - progress
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.lr - self.min_lr) * factor
