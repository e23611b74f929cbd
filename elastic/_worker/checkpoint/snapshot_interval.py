"""How many steps apart in-memory snapshots are: a fixed number, or, with `--snapshot-every auto`,
the interval that costs the least expected time (Young/Daly), re-measured as the run goes.

A snapshot costs the loop C seconds (measured: the loop blocked copying, plus
the snapshot thread's time writing, which on a busy host competes with the
step); a failure costs on average half an interval of redone work. With
failures M seconds apart on average, the expected loss per second is C/T for
the snapshots plus T/(2M) for the failures, least at Young's T = sqrt(2 C M);
Daly's higher-order form (J. T. Daly, "A higher order estimate of the optimum
checkpoint interval for restart dumps", FGCS 22(3), 2006) is used:

    T = sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C     (C < 2M; else T = M)

M is the job's: one worker's `--mtbf-hours` divided by the workers in the job
(failures independent per worker). The default, 50,000 hours, is Llama 3's:
419 unexpected interruptions in 54 days on 16,384 GPUs ("The Llama 3 Herd of
Models", Meta 2024, section 3.3.4), one per 50,700 GPU-hours.

Invariants:
- `every` changes only through `agree`, with the value the step vote carries
  (the largest any rank proposed), so every rank snapshots at the same steps
  and a restore finds every rank's part of a step.
- Under auto, snapshots are every step until the first snapshot's cost is
  measured, and never further apart than `--ckpt-every` (when it is set): a
  memory tier sparser than the disk tier would never be the newest.
- A proposal within 25 % of the current interval is the current interval: the
  measurements' noise does not move it (nor print a line) every step.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque

logger = logging.getLogger(__name__)

AUTO = "auto"
DEFAULT_MTBF_HOURS = 50_000.0
"""One worker's (a GPU's) mean time between failures, from Llama 3 (see the module docstring)."""
HYSTERESIS = 1.25
WINDOW = 32  # the recent steps and snapshots a proposal is measured on


def daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Daly's optimum seconds between snapshots that cost `cost_s`, failures `mtbf_s` apart."""
    if cost_s <= 0:
        return 0.0
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost_s


class SnapshotInterval:
    """The snapshot interval of one rank (see the module docstring)."""

    def __init__(
        self, setting: int | str, *, world_size: int, mtbf_hours: float, ckpt_every: int, announce: bool,
        clock=time.monotonic,
    ) -> None:
        self.auto = setting == AUTO
        self.every = 1 if self.auto else int(setting)
        self._job_mtbf_s = mtbf_hours * 3600.0 / max(1, world_size)
        self._world_size, self._mtbf_hours = world_size, mtbf_hours
        self._cap = ckpt_every if ckpt_every > 0 else None
        self._announce = announce
        self._clock = clock
        self._last_step_end: float | None = None
        self._step_seconds: deque[float] = deque(maxlen=WINDOW)
        self._costs: deque[float] = deque(maxlen=WINDOW)
        self.chosen: list[tuple[int, int]] = []
        """(step, interval) each time `agree` changed the interval."""

    def note_step_end(self) -> None:
        """Every step's end: the step's wall time, for converting seconds into steps."""
        now = self._clock()
        if self._last_step_end is not None:
            self._step_seconds.append(now - self._last_step_end)
        self._last_step_end = now

    def note_cost(self, seconds: float) -> None:
        """One finished snapshot's cost to the loop (blocking copy plus the writer's time)."""
        self._costs.append(seconds)

    def cost_s(self) -> float | None:
        return statistics.median(self._costs) if self._costs else None

    def step_s(self) -> float | None:
        return statistics.median(self._step_seconds) if self._step_seconds else None

    def optimum(self) -> int | None:
        """Daly's interval in steps, capped at `--ckpt-every`; None until a snapshot and a step are measured."""
        cost, step = self.cost_s(), self.step_s()
        if cost is None or not step:
            return None
        steps = max(1, round(daly_interval_s(cost, self._job_mtbf_s) / step))
        return min(steps, self._cap) if self._cap is not None else steps

    def proposal(self) -> int:
        """This rank's ballot for the interval from the next step on."""
        if not self.auto:
            return self.every
        best = self.optimum()
        if best is None or self.every / HYSTERESIS <= best <= self.every * HYSTERESIS:
            return self.every
        return best

    def agree(self, every: int, step: int) -> None:
        """Take the interval every rank agreed on (0: no rank snapshots; nothing changes)."""
        if every <= 0 or every == self.every:
            return
        self.every = every
        self.chosen.append((step, every))
        if self._announce and self.auto:
            logger.info("%s", self.describe())

    def describe(self) -> str:
        """The one line that says what auto chose and why."""
        cost, step = self.cost_s(), self.step_s()
        if cost is None or not step:
            return f"in-memory snapshots every {self.every} step(s) (--snapshot-every auto: not measured yet)"
        young_daly = max(1, round(daly_interval_s(cost, self._job_mtbf_s) / step))
        capped = f", capped at --ckpt-every {self._cap}" if self._cap is not None and young_daly > self._cap else ""
        return (
            f"in-memory snapshots every {self.every} steps (--snapshot-every auto: a snapshot costs the loop "
            f"{cost * 1e3:.1f} ms, a step takes {step * 1e3:.0f} ms, a failure is expected every "
            f"{self._job_mtbf_s / 3600:,.0f} h (--mtbf-hours {self._mtbf_hours:g} / {self._world_size} workers): "
            f"Young/Daly says {young_daly:,} steps{capped}; the largest of any rank's measurement is taken)"
        )
