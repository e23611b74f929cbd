"""Which rank is a straggler: the decision, from each rank's own work per step as the step vote carried it.

Every rank measures its own work per step: from the step's start to its arrival at the gradient
all-reduce (`WorkClock`), so the time a fast rank waits there for a slow one is not counted. Each
vote carries every rank's work per sample since its previous vote, in nanoseconds (0: no figure):
per sample, so a figure means the same whatever share of the global batch the rank trains
(`--slow-ranks rebalance` changes the shares; a rank rebalanced is still as slow).
`StragglerWatch.observe` turns the figures of one vote into episodes.

Invariants:
- A rank's slowdown in a vote is its work per sample over the median of the other ranks' (ranks
  without a figure left out); with fewer than two figures nobody is compared.
- A rank becomes a straggler when the median of its slowdowns over the last `window` votes is at
  least `factor`, and recovers when that median falls below `recover_below` (between 1 and
  `factor`: no flapping around the threshold). Each episode is reported once when it starts and
  once when it ends: `observe` returns only changes.
- The decision is a function of the figures alone: every rank, fed the same verdicts, reaches the
  same episodes at the same vote step (what a collective acting on them needs).
- A figure that is not an int in 0..MAX_FIGURE (a peer's bad value) is taken for "no figure".
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from time import perf_counter

MAX_FIGURE = 10**12
"""The largest work per sample a vote carries, in nanoseconds (about 17 minutes)."""


@dataclass(frozen=True)
class Episode:
    """A change in a rank's state: `started` a straggler episode, or ended it (recovered)."""

    rank: int
    started: bool
    slowdown: float
    """The median slowdown over the window at the change (work per sample over the others' median)."""


def slowdowns(figures: Sequence[int]) -> list[float | None]:
    """Each rank's work per sample over the median of the other ranks' (None: no figure, or no other figure).

    The figures are sorted once; the median of "every figure but this rank's" is read from that order
    around the rank's own place, so a vote costs O(N log N), not a median of N - 1 figures per rank
    (O(N^2 log N): about a second a vote at 1,024 ranks, on every rank)."""
    valid = [f if isinstance(f, int) and not isinstance(f, bool) and 0 < f <= MAX_FIGURE else None for f in figures]
    ordered = sorted(f for f in valid if f is not None)
    return [None if figure is None or len(ordered) < 2 else figure / _median_without(ordered, figure) for figure in valid]


def _median_without(ordered: list[int], figure: int) -> float:
    """The median of `ordered` (sorted) less one copy of `figure`, as statistics.median would give it."""
    skip = bisect.bisect_left(ordered, figure)
    count = len(ordered) - 1

    def at(index: int) -> int:
        return ordered[index if index < skip else index + 1]

    middle = count // 2
    return at(middle) if count % 2 else (at(middle - 1) + at(middle)) / 2


class StragglerWatch:
    """Straggler episodes from the votes' figures (see the module docstring)."""

    def __init__(self, *, factor: float, window: int, recover_below: float | None = None) -> None:
        if not factor > 1.0:
            raise ValueError(f"factor={factor} must be above 1")
        if window < 1:
            raise ValueError(f"window={window} must be at least 1")
        self.factor = factor
        self.window = window
        self.recover_below = recover_below if recover_below is not None else 1.0 + (factor - 1.0) / 2
        if not 1.0 <= self.recover_below <= factor:
            raise ValueError(f"recover_below={self.recover_below} must be between 1 and factor={factor}")
        self._history: dict[int, deque[float]] = {}
        self.slow: dict[int, float] = {}
        """The ranks in a straggler episode now, with their slowdown when it started."""

    def reset(self) -> None:
        """The group changed (ranks are others): forget every history; episodes in progress end unreported."""
        self._history.clear()
        self.slow.clear()

    def current(self, rank: int) -> float | None:
        """The median slowdown of `rank` over its window (None: a window not yet full)."""
        history = self._history.get(rank)
        return statistics.median(history) if history is not None and len(history) == self.window else None

    def observe(self, figures: Sequence[int]) -> list[Episode]:
        """One vote's figures (one per rank): the episodes that started or ended with it."""
        changes: list[Episode] = []
        for rank, slowdown in enumerate(slowdowns(figures)):
            if slowdown is None:
                continue
            self._history.setdefault(rank, deque(maxlen=self.window)).append(slowdown)
            level = self.current(rank)
            if level is None:
                continue
            if rank not in self.slow and level >= self.factor:
                self.slow[rank] = level
                changes.append(Episode(rank, True, level))
            elif rank in self.slow and level < self.recover_below:
                del self.slow[rank]
                changes.append(Episode(rank, False, level))
        for rank in [r for r in self._history if r >= len(figures)]:
            del self._history[rank]
            self.slow.pop(rank, None)
        return changes


class WorkClock:
    """One rank's work per sample: from each step's start to its arrival at the gradient all-reduce,
    over the samples of the step.

    `started` at the step's start, `arrived` by each gradient a backward pass accumulates (the last
    one counts: the all-reduce waits for it); a step with no backward pass counts to `ended(samples)`.
    `take` is the work per sample over the steps since the last `take`, in whole nanoseconds (0: none)."""

    def __init__(self, clock=perf_counter) -> None:
        self._clock = clock
        self._start: float | None = None
        self._arrival: float | None = None
        self._seconds = 0.0
        self._samples = 0

    def started(self) -> None:
        self._start, self._arrival = self._clock(), None

    def arrived(self) -> None:
        if self._start is not None:
            self._arrival = self._clock()

    def ended(self, samples: int) -> None:
        if self._start is None or samples < 1:
            self._start = self._arrival = None
            return
        end = self._arrival if self._arrival is not None else self._clock()
        self._seconds += max(0.0, end - self._start)
        self._samples += samples
        self._start = self._arrival = None

    def take(self) -> int:
        samples, seconds = self._samples, self._seconds
        self._samples, self._seconds = 0, 0.0
        return min(MAX_FIGURE, max(0, round(seconds / samples * 1e9))) if samples else 0


class LineBudget:
    """When a straggler episode gets a log line: at most one start line per rank each `interval` seconds.

    On a busy shared machine a rank's speed wanders, and episodes can start and end every few seconds; each
    one is still an event (the report and the metric see them all), but its line would bury the log. A start
    within `interval` of the rank's last line is counted instead and told with the next line that is said; an
    end is said only when its start was. Pure (the clock is the caller's)."""

    def __init__(self, interval: float = 60.0, clock=perf_counter) -> None:
        self.interval, self._clock = interval, clock
        self._last: dict[int, float] = {}
        self._held: dict[int, int] = {}
        self._said: set[int] = set()

    def start(self, rank: int) -> int | None:
        """A rank's episode started: None when it gets no line, else the episodes held back before it."""
        now = self._clock()
        if rank in self._last and now - self._last[rank] < self.interval:
            self._held[rank] = self._held.get(rank, 0) + 1
            self._said.discard(rank)
            return None
        self._last[rank] = now
        self._said.add(rank)
        return self._held.pop(rank, 0)

    def end(self, rank: int) -> bool:
        """A rank's episode ended: whether its line is said (its start's was)."""
        if rank in self._said:
            self._said.discard(rank)
            return True
        return False
