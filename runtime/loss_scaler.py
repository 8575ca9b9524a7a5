"""Loss scaling for fp16, with torch.amp.GradScaler's rules.

Dynamic: start at initial_scale; on a step with any inf/NaN gradient (on any
rank) multiply by backoff_factor and skip the step; after growth_interval clean
steps in a row multiply by growth_factor.  Fixed: a constant.  bf16 needs none
(scale 1), but its non-finite gradients still skip the step.
"""
from __future__ import annotations


class LossScaler:
    def __init__(self, *, dynamic: bool, scale: float, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.dynamic = dynamic
        self.scale = float(scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0

    @classmethod
    def for_config(cls, cfg) -> "LossScaler":
        """The scaler an OffloadConfig asks for: dynamic for fp16 with loss_scaling.scale="dynamic",
        fixed for a float, 1 for bf16."""
        ls = cfg.loss_scaling
        dynamic = cfg.dtype == "fp16" and ls.scale == "dynamic"
        scale = 1.0 if cfg.dtype == "bf16" else ls.initial_scale if ls.scale == "dynamic" else ls.scale
        return cls(dynamic=dynamic, scale=scale, growth_factor=ls.growth_factor, backoff_factor=ls.backoff_factor,
                   growth_interval=ls.growth_interval)

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "dynamic": self.dynamic}

    def load_state_dict(self, d: dict) -> None:
        self.scale = float(d["scale"])
        self.good_steps = int(d["good_steps"])
