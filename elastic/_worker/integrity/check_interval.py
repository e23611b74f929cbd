"""How many steps apart replica checks are: a fixed number, or, with `--replica-check-every auto`, the
fewest steps that keep the checks' cost under `BUDGET` of the loop's time, measured as the run goes.

A check costs the loop C seconds (measured, as a snapshot's cost is for
`--snapshot-every auto`: the digest of the parameters, the ranks' exchange
of digests, and the copy of the rollback point when the check passes); a
step takes S seconds (the median of the recent steps' wall times). Checks k
steps apart cost C / (k S) of the loop, so auto takes the least k with
C / (k S) <= BUDGET: k = ceil(C / (BUDGET S)).

Invariants:
- `every` changes only through `agree`, with the largest interval any rank
  proposed (carried by the check's own exchange of digests), so every rank
  checks at the same steps.
- Under auto, the first check comes `FIRST_AUTO` steps into the loop; its
  proposal rests on an estimate (`estimate`: the first rollback point's copy,
  twice: the digest reads every byte once more), every later one on the
  checks measured.
- A proposal within 25 % of the current interval is the current interval:
  the measurements' noise does not move it at every check.
- Checks also run at every periodic checkpoint (`also_every` steps apart,
  replica_check: a checkpoint only of a checked state); auto counts them in
  the budget, so the regular checks take what the budget leaves:
  1 / k <= BUDGET S / C - 1 / also_every (none left: checks only at saves).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable

AUTO = "auto"
BUDGET = 0.005
"""The share of the loop's time checks may cost under auto (0.5 %)."""
FIRST_AUTO = 10
HYSTERESIS = 1.25
WINDOW = 32
MAX_EVERY = 1 << 30
"""The largest interval a rank may propose (a peer's larger one is refused as malformed)."""


def now() -> float:
    """The clock a step's wall time is read from (monotonic seconds). A benchmark that runs several
    loops in turns in one process replaces it with one that stops while a loop waits for its turn."""
    return time.monotonic()


def auto_every(cost_s: float, step_s: float, budget: float = BUDGET, also_every: int = 0) -> int:
    """The fewest steps between checks that cost `cost_s` each so that they take at most `budget`
    of a loop whose steps take `step_s`, with a check at every `also_every` steps anyway (0: none)."""
    if cost_s <= 0 or step_s <= 0:
        return 1
    rate = budget * step_s / cost_s - (1 / also_every if also_every > 0 else 0.0)  # checks per step left
    if rate <= 1 / MAX_EVERY:
        return MAX_EVERY
    return max(1, min(MAX_EVERY, math.ceil(1 / rate - 1e-9)))


class CheckInterval:
    """One rank's replica check interval (see the module docstring)."""

    def __init__(self, setting: int | str, *, clock: Callable[[], float] | None = None, also_every: int = 0) -> None:
        self.auto = setting == AUTO
        self.also_every = also_every
        self.every = FIRST_AUTO if self.auto else int(setting)
        self._clock = clock if clock is not None else lambda: now()  # looked up at each call
        self._last_end: float | None = None
        self._step_seconds: deque[float] = deque(maxlen=WINDOW)
        self._costs: deque[float] = deque(maxlen=WINDOW)
        self._estimate: float | None = None

    def note_step_end(self, *, paused: bool = False) -> None:
        """Every step's end; `paused`: the time since the last one held a check or a rollback (not a step's)."""
        now = self._clock()
        if self._last_end is not None and not paused:
            self._step_seconds.append(now - self._last_end)
        self._last_end = now

    def note_cost(self, seconds: float) -> None:
        self._costs.append(seconds)

    def estimate(self, seconds: float) -> None:
        """A check's cost before any is measured (the measured ones replace it)."""
        self._estimate = seconds

    def cost_s(self) -> float | None:
        return statistics.median(self._costs) if self._costs else self._estimate

    def step_s(self) -> float | None:
        return statistics.median(self._step_seconds) if self._step_seconds else None

    def proposal(self) -> int:
        """This rank's ballot for the interval after the check it is cast at."""
        cost, step = self.cost_s(), self.step_s()
        if not self.auto or cost is None or not step:
            return self.every
        best = auto_every(cost, step, also_every=self.also_every)
        return self.every if self.every / HYSTERESIS <= best <= self.every * HYSTERESIS else best

    def agree(self, every: int) -> bool:
        """Take the interval every rank agreed on; True when it changed."""
        if every <= 0 or every == self.every:
            return False
        self.every = every
        return True

    def describe(self) -> str:
        cost, step = self.cost_s(), self.step_s()
        if not self.auto:
            return f"replica checks every {self.every} steps"
        if cost is None or not step:
            return f"replica checks every {self.every} steps (--replica-check-every auto: not measured yet)"
        return (f"replica checks every {self.every} steps (--replica-check-every auto: a check costs the loop "
                f"{cost * 1e3:.1f} ms, a step takes {step * 1e3:.1f} ms: at most {BUDGET:.1%} of the loop's time; "
                "the largest of any rank's measurement is taken)")
