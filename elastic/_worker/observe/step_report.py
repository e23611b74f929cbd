"""A finished step's record: its event line, its progress line and its loss, read one step late.

Invariants:
- A step's loss is read (`.item()`, a device sync) only when the next step
  ends, so the host never waits on the device mid-loop; `flush` reads it now
  (before a checkpoint, an evaluation, the end).
- The time each part takes is charged to the step costs: the event listeners
  (the metrics) as "metrics", the rest as "report".
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from elastic._worker.observe.events import EventLog
from elastic._worker.observe.progress import Progress
from elastic._worker.observe.step_costs import StepCosts


@dataclass
class _StepRecord:
    step: int
    loss: torch.Tensor | None
    time: float


class StepReport:
    """Reports each step one step late (see the module docstring)."""

    def __init__(self, events: EventLog, costs: StepCosts, *, world_size: int) -> None:
        self._events, self._costs, self._world_size = events, costs, world_size
        self.last_loss = math.nan
        """The newest loss read (nan before any)."""
        self.progress: Progress | None = None
        self._pending: _StepRecord | None = None
        self._last_time = time.time()
        self._per_step = 0  # samples (or tokens) the whole job takes per step

    def start_loop(self, *, total: int, initial: int, enabled: bool, log_every: int, per_step: int, unit: str) -> None:
        """A loop starts now: throughput (`per_step` `unit` a step) counts from here; the progress of the
        first loop (up to step `total`) is kept for the later ones."""
        if self.progress is None:
            self.progress = Progress(total=total, initial=initial, enabled=enabled, log_every=log_every, unit=unit)
        self._per_step = per_step
        self._last_time = time.time()

    def resize(self, world_size: int, per_step: int) -> None:
        """The group changed in place (elastic._worker.survivors.views): the step pending is reported at the size it
        ran at, the steps after it at `world_size`, `per_step` units each."""
        self.flush()
        self._world_size, self._per_step = world_size, per_step

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()

    def record(self, step: int, loss: torch.Tensor | None) -> None:
        """`step` ended with `loss` (not read yet); the step before it is reported now."""
        self.flush()
        self._pending = _StepRecord(step, loss, time.time())

    def flush(self) -> None:
        """Report the step still pending, if any."""
        if self._pending is None:
            return
        started, listening = time.perf_counter(), self._events.listener_seconds
        record, self._pending = self._pending, None
        fields = {}
        if record.loss is not None:
            self.last_loss = fields["loss"] = record.loss.item()
        elapsed, self._last_time = record.time - self._last_time, record.time
        self._events.emit("step", step=record.step, world_size=self._world_size, time=record.time, **fields)
        if self.progress is not None:
            rate = self._per_step / max(elapsed, 1e-9)
            self.progress.update(record.step, loss=fields.get("loss", math.nan), tokens_per_s=rate)
        metrics = self._events.listener_seconds - listening
        self._costs.add("metrics", metrics)
        self._costs.add("report", time.perf_counter() - started - metrics)
