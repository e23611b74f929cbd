"""`--slow-ranks evict`: the last resort for a straggler that rebalancing cannot carry.

    evictions = Evictions(factor=3.0)
    for found in evictions.observe(watch, shares, per_sample): ...   # every rank, at the same vote step

A rank is evicted when, over the same window of votes as the straggler decision
(elastic._worker.observe.stragglers), either
- its median slowdown is at least `factor` (`--evict-factor`, above `--slow-factor`), or
- it is a straggler, its share of the global batch is already the smallest (one sample), and it
  still sets the step: one sample of its takes longer than the whole share of every other rank, so
  no split can shorten the step further.

What an eviction does (elastic._worker.observe.slow_ranks acts on it):
- under torchrevive-run --survivors train-on, when the job keeps its minimum world size without the
  rank's node: a `straggler_evicted` event (action `evicted`), one line, and the rank's worker exits
  with `EVICTED_EXIT`; its agent's failure policy sets the node aside at once (its agent leaves the
  job) and the survivors train on at the smaller world size, every sample once (the elastic sampler);
- otherwise (no train-on, or the job at its minimum): the event says `action: kept` and why, and the
  rank stays, rebalanced: evict acts as rebalance plus the report.

Invariants: `observe` depends only on its arguments and on what it returned before, so every rank,
fed the same votes, evicts the same rank at the same vote step; at most one rank per vote (the
slowest), and each rank's eviction is returned once per straggler episode (a rank kept is not
reported again at every vote until it recovers and becomes a straggler again).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from elastic._shared.common.errors import ElasticError
from elastic._shared.protocol.exit_status import EVICTED_EXIT
from elastic._worker.observe.stragglers import StragglerWatch


class EvictedError(ElasticError):
    """This rank was evicted as a straggler: its worker leaves the job with `EVICTED_EXIT`."""

    exit_code = EVICTED_EXIT


@dataclass(frozen=True)
class Eviction:
    rank: int
    slowdown: float
    """The rank's median slowdown over the window."""
    reason: str
    """Why, in words ("3.4x the others' median, at least --evict-factor 3")."""


class Evictions:
    """Which rank to evict, from the straggler watch and the shares in effect (see the module docstring)."""

    def __init__(self, *, factor: float) -> None:
        if not factor > 1.0:
            raise ValueError(f"factor={factor} must be above 1")
        self.factor = factor
        self._returned: set[int] = set()

    def reset(self) -> None:
        """The group changed: other ranks."""
        self._returned.clear()

    def observe(self, watch: StragglerWatch, shares: Sequence[int], per_sample: Sequence[float] | None) -> Eviction | None:
        """The rank to evict after this vote (None: nobody). `watch` has observed the vote already;
        `shares` are the samples per rank in effect; `per_sample` each rank's median work per sample
        over the window (None while a window is not full: then only the factor decides)."""
        self._returned &= set(watch.slow)  # a rank that recovered may be returned in a later episode
        found: list[Eviction] = []
        for rank in sorted(watch.slow):
            level = watch.current(rank)
            if level is None or rank in self._returned or rank >= len(shares):
                continue
            if level >= self.factor:
                found.append(Eviction(rank, level, f"{level:.2f}x the median of the others' work per sample, "
                                                   f"at least --evict-factor {self.factor:g}"))
            elif per_sample is not None and too_slow_to_rebalance(rank, shares, per_sample):
                found.append(Eviction(rank, level, f"{level:.2f}x the others' median with a share of one sample, "
                                                   "which still takes longer than every other rank's whole share"))
        if not found:
            return None
        chosen = max(found, key=lambda e: (e.slowdown, -e.rank))
        self._returned.add(chosen.rank)
        return chosen


def too_slow_to_rebalance(rank: int, shares: Sequence[int], per_sample: Sequence[float]) -> bool:
    """`rank` holds the smallest share (one sample) and still sets the step: its one sample takes longer
    than any other rank's whole share."""
    if len(shares) != len(per_sample) or len(shares) < 2 or shares[rank] > 1:
        return False
    others = max(n * t for r, (n, t) in enumerate(zip(shares, per_sample)) if r != rank)
    return per_sample[rank] > others
