"""Learning-rate schedule: linear warm-up, then cosine decay to min_ratio x peak."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(kw_only=True)
class WarmupCosine:
    """lr(k) for the 1-based update k.  warmup: updates of linear ramp; total: updates in the run."""
    peak: float
    warmup: int
    total: int
    min_ratio: float = 0.1

    def __post_init__(self) -> None:
        if not self.peak >= 0:
            raise ValueError(f"peak lr must be >= 0, got {self.peak}")
        if self.warmup < 0 or self.total < 1:
            raise ValueError(f"warmup must be >= 0 and total >= 1, got {self.warmup}, {self.total}")

    def __call__(self, k: int) -> float:
        if self.warmup and k <= self.warmup:
            return self.peak * k / self.warmup
        span = max(1, self.total - self.warmup)
        t = min(1.0, (k - self.warmup) / span)
        return self.peak * (self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))
