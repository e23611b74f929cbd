"""`--slow-ranks rebalance`: each rank's share of the global batch follows its measured speed, and its
gradient is weighted by its share, so the update is the even split's.

Invariants:
- The shares change only in `Rebalancer.observe`, fed the step vote's figures: every rank reads the
  same figures at the same vote step and holds the same shares, so every rank computes the same new
  shares there (elastic._worker.data.shares) and sets them at the same step end. The global batch
  is unchanged: the epoch stream, and exactly-once, are the sampler's (elastic._worker.data.sampler).
- A change is made only once every rank's window of figures is full, and only when the predicted
  step (the slowest rank's share times its time per sample) is at least `min_gain` shorter: noise
  does not move the cut back and forth.
- `GradientWeights`: each gradient this rank's backward accumulates is multiplied by
  share / batch_size before DDP averages it over the W ranks, so the averaged gradient is
  sum_r (n_r / N) * mean-loss gradient of rank r: the gradient of the mean loss over the global
  batch, as with an even split (for a loss that is a mean over the batch). At the even share the
  factor is exactly 1 and the gradient is left alone (the same bits).
- Where it can, the factor rides in DDP's own averaging: a communication hook that multiplies each
  bucket by share / (batch_size x W) where DDP multiplies it by 1/W, then sums it over the ranks (at
  the even share 1/W: DDP's own arithmetic). No pass over the gradients is added: a hook on
  each parameter (the fallback, for a DDP that has a communication hook already, such as the
  survivors', or a model that is no DDP) costs an extra multiply and a new tensor per gradient, about
  a quarter of a small model's step on CPU.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.data.shares import balanced_shares, step_time
from elastic._worker.observe.stragglers import MAX_FIGURE

MIN_GAIN = 0.05
"""A new split must predict a step at least this much shorter (a fraction) to be taken."""


class GradientWeights:
    """Multiplies each gradient `model`'s backward accumulates by `scale` (see the module docstring): in
    `ddp`'s all-reduce when it is a DDP without a communication hook (`in_all_reduce`), else by a hook on
    each parameter."""

    def __init__(self, model: torch.nn.Module | None, ddp: Any = None) -> None:
        self.scale = 1.0
        self._hooks: list[Any] = []
        self.in_all_reduce = False
        self._group: Any = None
        if model is None:
            return
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and not getattr(ddp, "_comm_hooks", None):
            self._group = ddp.process_group
            ddp.register_comm_hook(self, _weighted_all_reduce)
            self.in_all_reduce = True
        else:
            self._hooks = [p.register_hook(self._scaled) for p in model.parameters() if p.requires_grad]

    def _scaled(self, grad: torch.Tensor) -> torch.Tensor:
        return grad if self.scale == 1.0 else grad * self.scale

    def close(self) -> None:
        """No weight from now on. (DDP cannot take a communication hook back: at scale 1 it is DDP's mean.)"""
        self.scale = 1.0
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def _weighted_all_reduce(weights, bucket):  # noqa: ANN001, ANN202 - DDP rejects a hook whose annotations are strings
    """DDP's mean of a bucket over the ranks, each rank's part weighted by `weights.scale`: one pass over
    the bucket, where DDP multiplies by 1/world (the same arithmetic at scale 1)."""
    tensor = bucket.buffer()
    world = weights._group.size()
    tensor.mul_(weights.scale / world)  # DDP's own copy multiplies each gradient by 1/world: at scale 1, the same bits
    work = dist.all_reduce(tensor, group=weights._group, async_op=True)
    return work.get_future().then(lambda done: done.value()[0])


class Rebalancer:
    """New shares from the votes' figures (ns of work per sample, one per rank); see the module docstring."""

    def __init__(self, sampler: ElasticSampler, *, window: int, min_gain: float = MIN_GAIN) -> None:
        self.sampler = sampler
        self.window = window
        self.min_gain = min_gain
        self._history: list[deque[int]] = []
        self.per_sample: list[float] | None = None
        """Each rank's median work per sample over the window, once every window is full (else None)."""

    def reset(self) -> None:
        self._history = []
        self.per_sample = None

    def observe(self, figures: Sequence[int]) -> tuple[int, ...] | None:
        """One vote's figures: the shares to take now, or None to keep those in effect."""
        world = len(figures)
        if len(self._history) != world:
            self._history = [deque(maxlen=self.window) for _ in range(world)]
        for rank, figure in enumerate(figures):
            if isinstance(figure, int) and not isinstance(figure, bool) and 0 < figure <= MAX_FIGURE:
                self._history[rank].append(figure)
        if world < 2 or any(len(h) < self.window for h in self._history):
            self.per_sample = None
            return None
        per_sample = self.per_sample = [float(statistics.median(h)) for h in self._history]
        current = tuple(self.sampler.share(rank, world)[1] for rank in range(world))
        proposed = balanced_shares(per_sample, sum(current))
        if proposed == current or step_time(proposed, per_sample) > (1 - self.min_gain) * step_time(current, per_sample):
            return None
        return proposed
