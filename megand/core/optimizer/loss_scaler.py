"""Loss scaling for fp16: the loss is multiplied by ``scale`` before backward, the main gradients by
``1/scale`` before the step. Dynamic (Megatron's DynamicGradScaler): after ``hysteresis`` steps with
inf/nan gradients the scale is multiplied by ``backoff`` (not below ``min_scale``); after
``growth_interval`` clean steps in a row it is multiplied by ``growth``."""

from __future__ import annotations


class ConstantLossScaler:
    """fp32 and bf16: no scaling (scale 1, so the math is unchanged)."""

    scale = 1.0

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        pass


class DynamicLossScaler:
    def __init__(self, initial_scale: float, min_scale: float = 1.0, growth_interval: int = 1000,
                 hysteresis: int = 2, growth: float = 2.0, backoff: float = 0.5):
        assert initial_scale > 0 and min_scale > 0 and growth > 1 and 0 < backoff < 1 and hysteresis >= 1
        self.scale, self.min_scale = float(initial_scale), float(min_scale)
        self.growth_interval, self.hysteresis, self.growth, self.backoff = growth_interval, hysteresis, growth, backoff
        self.growth_tracker, self.hysteresis_tracker = 0, hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker, self.hysteresis_tracker = 0, self.hysteresis
                self.scale *= self.growth

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker, "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state.get("growth_tracker", 0))
        self.hysteresis_tracker = int(state.get("hysteresis_tracker", self.hysteresis))
