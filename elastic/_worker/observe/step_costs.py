"""Where the runtime's time on the loop goes: seconds per part of its per-step work.

`Run` charges each part of what it does around a training step to a phase;
`Run.finish()` returns the totals divided by the steps (`per_step`), which
`benchmarks/overhead.py` prints as shares of the step. Measuring costs two
clock reads per phase per step (well under a microsecond each).

Phases (what the loop waits for; work on background threads is not here
unless the loop waits for it):
- sampler: the data position (the batch the sampler assigns, the loader's check, the advance);
- report: the step's event line, progress, the loss read one step late;
- metrics: the event listeners (the /metrics counters);
- vote: starting the step vote and waiting for its answer (elastic._worker.control.step_vote);
- checkpoint: deciding on and starting saves, collecting finished ones, the
  optimizer step's wait for a save's copy;
- snapshot_copy: the loop's part of an in-memory snapshot's copy;
- snapshot_wait: waiting for the previous snapshot (at the next one, and at
  the optimizer step, which may not change parameters a snapshot still copies);
- watchdog: feeding the hang watchdog, the chaos fault hook;
- integrity: replica checks (digests, their exchange, the rollback point's
  copy) and the numeric guard's reading before the optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from time import perf_counter

PHASES = ("sampler", "report", "metrics", "vote", "checkpoint", "snapshot_copy", "snapshot_wait", "watchdog", "integrity")


class StepCosts:
    """Seconds charged to each phase, and the steps they were spread over."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    @contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        started = perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += perf_counter() - started

    def per_step(self) -> dict[str, float]:
        """Seconds per step of each phase (0 before any step)."""
        return {phase: seconds / self.steps if self.steps else 0.0 for phase, seconds in self.seconds.items()}
