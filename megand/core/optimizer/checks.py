"""Range checks of the optimizer values, each raising ValueError with one line naming the key and value.

``check_common`` covers what every optimizer and the learning-rate schedule read; each optimizer record
checks its own values (``OptimizerRecord.check``), and a run checks the record of ``optim.name`` and of
every fallback it updates some parameters with (Muon checks AdamW's betas too).
"""

from __future__ import annotations


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def in_unit_interval(o, key: str, closed_high: bool = False) -> None:
    """``0 <= optim.<key> < 1`` (``<= 1`` when ``closed_high``)."""
    v = getattr(o, key)
    ok = 0.0 <= v <= 1.0 if closed_high else 0.0 <= v < 1.0
    require(ok, f"optim.{key}={v} must be in [0, 1{']' if closed_high else ')'}")


def check_common(o) -> None:
    require(o.lr > 0, f"optim.lr={o.lr} must be > 0")
    require(0 <= o.min_lr <= o.lr, f"optim.min_lr={o.min_lr} must be between 0 and optim.lr={o.lr}")
    require(o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay} must be >= 0")
    require(o.clip_grad >= 0, f"optim.clip_grad={o.clip_grad} must be >= 0 (0: no clipping)")
    require(o.initial_loss_scale > 0, f"optim.initial_loss_scale={o.initial_loss_scale} must be > 0")
    require(0 < o.min_loss_scale <= o.initial_loss_scale,
            f"optim.min_loss_scale={o.min_loss_scale} must be between 0 (excluded) and "
            f"optim.initial_loss_scale={o.initial_loss_scale}")
    require(o.loss_scale_window >= 1, f"optim.loss_scale_window={o.loss_scale_window} must be >= 1")
    require(o.hysteresis >= 1, f"optim.hysteresis={o.hysteresis} must be >= 1")


def check_schedule(o, decay_iters: int, iters: int) -> None:
    """The schedule's step order: warm-up, then (WSD) the decay start, then the end of the decay. A warm-up
    longer than the whole run is fine (the run only warms up); one that ends after the decay would drop the
    rate from the peak to ``min_lr`` in one step, so it is refused when the run goes past it."""
    require(o.warmup_iters >= 0, f"optim.warmup_iters={o.warmup_iters} must be >= 0")
    require(o.schedule == "constant" or o.warmup_iters <= decay_iters or iters <= o.warmup_iters,
            f"optim.warmup_iters={o.warmup_iters} ends after the decay (end {decay_iters}: optim.decay_iters, "
            f"null: train.iters) of optim.schedule={o.schedule}, and train.iters={iters} goes past both")
    require(0.0 <= o.decay_fraction <= 1.0, f"optim.decay_fraction={o.decay_fraction} must be between 0 and 1")
    require(o.decay_start is None or o.warmup_iters <= o.decay_start <= decay_iters,
            f"optim.decay_start={o.decay_start} must lie between optim.warmup_iters={o.warmup_iters} and "
            f"the end of the decay {decay_iters} (optim.decay_iters, null: train.iters)")
    start = o.decay_start if o.decay_start is not None else decay_iters - round(o.decay_fraction * decay_iters)
    require(o.schedule != "wsd" or start >= o.warmup_iters,
            f"optim.schedule=wsd decays from step {start} (optim.decay_fraction={o.decay_fraction} of "
            f"{decay_iters} steps), inside the warm-up (optim.warmup_iters={o.warmup_iters})")
