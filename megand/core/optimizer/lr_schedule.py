"""Learning-rate schedules: linear warm-up, then cosine, linear or constant decay to ``min_lr``, or
warmup-stable-decay (WSD).

With ``t`` the schedule's position (optimizer step, 1-based; with a batch-size ramp-up the samples consumed
once the step is done divided by the final global batch size, so that ``t`` counts steps of the final
batch), ``W`` = ``warmup_iters``, ``D`` = ``decay_iters``, ``peak`` = ``lr``, ``low`` = ``min_lr``::

    t <= W:              lr(t) = peak * t / W
    cosine / linear:     p = min(1, (t - W) / max(1, D - W));  lr(t) = low + (peak - low) * f(p)
    constant:            lr(t) = peak
    wsd:                 S = decay_start, or D - round(decay_fraction * D) when decay_start is None
                         t <= S: lr(t) = peak                                        (stable)
                         t >  S: p = min(1, (t - S) / max(1, D - S)); lr(t) = low + (peak - low) * f(p)

with the decay shape ``f``: ``linear`` 1 - p, ``cosine`` (1 + cos(pi p)) / 2, ``1-sqrt`` 1 - sqrt(p)
(``schedule=cosine|linear`` use their own shape, ``wsd`` uses ``decay_style``).

WSD keeps the peak until ``S``: extending a run (a longer ``decay_iters``, by default ``train.iters``)
extends the stable phase, and a cooldown from any stable checkpoint at iteration ``k`` is
``decay_start=k`` with ``decay_iters`` (``train.iters``) the end of the cooldown.
"""

import math

SCHEDULES = ("cosine", "linear", "constant", "wsd")
DECAY_STYLES = ("linear", "cosine", "1-sqrt")


def decay_factor(style: str, progress: float) -> float:
    """The decay shape ``f(p)``: 1 at the start of the decay (p = 0), 0 at its end (p = 1)."""
    if style == "linear":
        return 1.0 - progress
    if style == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if style == "1-sqrt":
        return 1.0 - math.sqrt(progress)
    raise ValueError(f"decay style {style!r}: expected one of {', '.join(DECAY_STYLES)}")


class LRSchedule:
    def __init__(self, lr, min_lr, warmup_iters, decay_iters, kind="cosine", decay_style="1-sqrt",
                 decay_fraction=0.2, decay_start=None):
        if kind not in SCHEDULES:
            raise ValueError(f"schedule {kind!r}: expected one of {', '.join(SCHEDULES)}")
        self.lr, self.min_lr, self.warmup_iters, self.decay_iters, self.kind = lr, min_lr, warmup_iters, decay_iters, kind
        self.decay_style = decay_style if kind == "wsd" else kind
        self.decay_start = (decay_start if decay_start is not None else
                            decay_iters - round(decay_fraction * decay_iters)) if kind == "wsd" else warmup_iters

    def __call__(self, step: float) -> float:
        """The learning rate at schedule position ``step`` (optimizer step, 1-based; see the module)."""
        if self.warmup_iters and step <= self.warmup_iters:
            return self.lr * step / self.warmup_iters
        if self.kind == "constant" or step <= self.decay_start:
            return self.lr
        progress = min(1.0, (step - self.decay_start) / max(1, self.decay_iters - self.decay_start))
        return self.min_lr + (self.lr - self.min_lr) * decay_factor(self.decay_style, progress)
