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


@dataclass(frozen=True)
class OneCycle:
    """The one-cycle policy: cosine rise from `1 / div_factor` x base LR to the base
    LR over `warmup_steps`, then cosine fall to `1 / final_div_factor` x base LR at
    `total_steps`, flat after that (torch's OneCycleLR shape, LR only)."""

    warmup_steps: int
    total_steps: int
    div_factor: float = 25.0
    final_div_factor: float = 1e4

    def __post_init__(self) -> None:
        if not 0 <= self.warmup_steps <= self.total_steps or self.total_steps < 1:
            raise ValueError(f"need 0 <= warmup_steps <= total_steps and total_steps >= 1, got {self}")
        if self.div_factor < 1 or self.final_div_factor < 1:
            raise ValueError(f"div_factor and final_div_factor must be >= 1, got {self}")

    def __call__(self, step: int) -> float:
        start, end = 1.0 / self.div_factor, 1.0 / (self.div_factor * self.final_div_factor)
        if step < self.warmup_steps:
            return _cosine_between(start, 1.0, step / self.warmup_steps)
        span = max(1, self.total_steps - self.warmup_steps)
        return _cosine_between(1.0, end, min(1.0, (step - self.warmup_steps) / span))


def _cosine_between(start: float, end: float, progress: float) -> float:
    """From `start` at progress 0 to `end` at progress 1 along half a cosine."""
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * progress))
