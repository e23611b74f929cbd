"""Learning-rate schedules as plain callables for `torch.optim.lr_scheduler.LambdaLR`.

They are dataclasses of numbers, so `LambdaLR.state_dict()` stores them as
plain types and a checkpoint loads with `weights_only=True`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class WarmupCosine:
    """Linear warmup to the base LR over `warmup_steps`, then cosine decay to
    `min_ratio` x base LR at `total_steps`, flat after that."""

    warmup_steps: int
    total_steps: int
    min_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError(f"need warmup_steps >= 0 and total_steps >= 1, got {self}")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"min_ratio={self.min_ratio} must be in [0, 1]")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
