"""How many steps apart in-memory snapshots are: a fixed number, or, with `--snapshot-every auto`, as
often as a fixed share of the loop's time buys, measured as the run goes.

A snapshot costs the loop C seconds (snapshot_costs.py: the loop's own time
for it plus the CPU time of its write on the snapshot thread); a step takes S
seconds (the median of the recent steps' wall times). Snapshots k steps apart
cost C / (k S) of the loop, so auto takes the least k with C / (k S) <= BUDGET,
k = ceil(C / (BUDGET S)), as the replica checks' auto does
(elastic._worker.integrity.check_interval). The fewer steps apart, the fewer a
worker's death makes the job train again: at the GPT recipe's default size a
snapshot costs under 1 % of a step, so auto snapshots at every step and a
failure redoes none (memory.py says where one step can still be redone).

Each snapshot is also copied to the peer node (the peer-replica tier, which
a node's loss restores from): that copy costs R seconds of the snapshot
thread's CPU (its tag, its send; about as much again on the peer, which is
not this loop's), budgeted apart, R / (k S) <= REPLICA_BUDGET, because it
buys protection from another failure than a worker's death (a node's loss);
the interval is the larger of the two tiers'.

Young/Daly's optimum is kept as an upper bound on k. A snapshot every T
seconds loses C/T to snapshots and, with failures M seconds apart, T/(2M) to
work redone; that sum is least at Young's T = sqrt(2 C M), for which Daly's
higher-order form is used (J. T. Daly, "A higher order estimate of the
optimum checkpoint interval for restart dumps", FGCS 22(3), 2006):

    T = sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C     (C < 2M; else T = M)

Under the budget that bound binds only when failures come so often that
snapshots closer than the budget allows lose less time in all (a costly
snapshot on a job that fails every few minutes); with failures as rare as M's
default, T is thousands of steps and the budget decides. M is the job's: one
worker's `--mtbf-hours` divided by the workers in the job (failures
independent per worker). The default, 50,000 hours, is Llama 3's: 419
unexpected interruptions in 54 days on 16,384 GPUs ("The Llama 3 Herd of
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
BUDGET = 0.01
"""The share of the loop's time snapshots may cost under auto (1 %)."""
REPLICA_BUDGET = 0.01
"""The share their copies to the peer node may cost (1 %; none when the job runs on one node)."""
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


def budget_every(cost_s: float, step_s: float, budget: float = BUDGET) -> int:
    """The fewest steps between snapshots that cost `cost_s` each so that they take at most `budget`
    of a loop whose steps take `step_s`."""
    if cost_s <= 0 or step_s <= 0:
        return 1
    return max(1, math.ceil(cost_s / (budget * step_s) - 1e-9))


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
        self._replica_costs: deque[float] = deque(maxlen=WINDOW)
        self._told = False  # the measured choice was logged
        self.chosen: list[tuple[int, int]] = []
        """(step, interval) each time `agree` changed the interval."""

    def note_step_end(self) -> None:
        """Every step's end: the step's wall time, for converting seconds into steps."""
        now = self._clock()
        if self._last_step_end is not None:
            self._step_seconds.append(now - self._last_step_end)
        self._last_step_end = now

    def note_cost(self, seconds: float, replica_seconds: float = 0.0) -> None:
        """One finished snapshot's cost to the loop and its copy's to the peer node
        (snapshot_costs.SnapshotCost.seconds and .replica_seconds)."""
        self._costs.append(seconds)
        self._replica_costs.append(replica_seconds)

    def cost_s(self) -> float | None:
        return statistics.median(self._costs) if self._costs else None

    def replica_cost_s(self) -> float:
        return statistics.median(self._replica_costs) if self._replica_costs else 0.0

    def step_s(self) -> float | None:
        return statistics.median(self._step_seconds) if self._step_seconds else None

    def young_daly(self) -> int | None:
        """Young/Daly's interval in steps for the whole snapshot's cost (both tiers); None until a
        snapshot and a step are measured."""
        cost, step = self.cost_s(), self.step_s()
        if cost is None or not step:
            return None
        return max(1, round(daly_interval_s(cost + self.replica_cost_s(), self._job_mtbf_s) / step))

    def budgets(self) -> int | None:
        """The fewest steps apart that keep both tiers within their budgets; None until measured."""
        cost, step = self.cost_s(), self.step_s()
        if cost is None or not step:
            return None
        return max(budget_every(cost, step), budget_every(self.replica_cost_s(), step, REPLICA_BUDGET))

    def optimum(self) -> int | None:
        """The budgets' interval in steps, at most Young/Daly's and `--ckpt-every`; None until a
        snapshot and a step are measured."""
        budget, bound = self.budgets(), self.young_daly()
        if budget is None or bound is None:
            return None
        steps = min(budget, bound)
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
        """Take the interval every rank agreed on (0: no rank snapshots; nothing changes). Under auto the
        announcing rank logs each change, and the first measured choice even when it is no change."""
        if every <= 0:
            return
        changed = every != self.every
        if changed:
            self.every = every
            self.chosen.append((step, every))
        if self._announce and self.auto and (changed or not self._told) and self.cost_s() is not None:
            self._told = True
            logger.info("%s", self.describe())

    def describe(self) -> str:
        """The one line that says what auto chose and why."""
        cost, step, bound, budget = self.cost_s(), self.step_s(), self.young_daly(), self.budgets()
        if cost is None or not step or bound is None or budget is None:
            return f"in-memory snapshots every {self.every} step(s) (--snapshot-every auto: not measured yet)"
        replica = self.replica_cost_s()
        copy = f" and its copy to the peer node {replica * 1e3:.1f} ms, {replica / step:.2%}" if replica else ""
        why = [f"{BUDGET:.0%} of the loop{' for each' if replica else ''} buys one every {budget:,} step(s)"]
        if bound < budget:
            why.append(f"Young/Daly's optimum is {bound:,} (a failure expected every "
                       f"{self._job_mtbf_s / 3600:,.1f} h: --mtbf-hours {self._mtbf_hours:g} / {self._world_size} workers)")
        if self._cap is not None and min(budget, bound) > self._cap:
            why.append(f"capped at --ckpt-every {self._cap}")
        return (
            f"in-memory snapshots every {self.every} step(s) (--snapshot-every auto: a snapshot costs the loop "
            f"{cost * 1e3:.1f} ms, {cost / step:.2%} of a {step * 1e3:.0f} ms step{copy}; " + "; ".join(why)
            + "; the largest of any rank's proposal is taken)"
        )
