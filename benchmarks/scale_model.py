"""The simulator's arithmetic: each path's figures from its phases, the growth fit, the capacity model.

Pure (no I/O): scale.py measures, this turns measurements into the table's figures, and a unit test
(tests/unit/test_scale_model.py) checks it on numbers written by hand.

- `figures`: one path at one N: the median rank's store operations and bytes per event (the
  aggregator's apart), the busiest store's operations per second, the wall time.
- `growth`: which of constant, log N, N, N^2 fits a series best (least squares of `a + b f(N)`,
  relative residuals; the simplest model within `TIE` of the best wins).
- `capacity`: the store load of a job of R ranks (R/`ranks_per_node` agents) during a failure and
  between failures, from the per-rank figures (scale_capacity.py compares it with what a store served).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

@dataclass(frozen=True)
class Row:
    """One line of the table: a phase of a path, per event."""

    name: str
    path: str
    phase: str
    events: Callable[[Any, int], float]
    """Events per rank in the phase (looks, seconds, votes) from its phase record and N: figures are per event."""
    aggregator: bool = False
    """The path has one rank allowed O(N) work (its figures are apart from the median rank's)."""
    unit: str = "store"
    """"store": store operations; "collective": collectives, and their bytes."""


def once(phase: Any, n: int) -> float:
    return 1.0


def per_count(key: str) -> Callable[[Any, int], float]:
    """Events per rank: the phase's count `key` (summed over ranks) over the ranks in it."""
    def events(phase: Any, n: int) -> float:
        return phase.extra.get(key, len(phase.ops)) / max(len(phase.ops), 1)

    return events


GROWTHS = ("constant", "log", "linear", "quadratic")
TIE = 0.1
"""A simpler model whose residual is within this fraction (of the series' spread) of the best one wins."""

_SHAPES = {
    "constant": lambda n: 0.0,
    "log": lambda n: math.log(n),
    "linear": lambda n: float(n),
    "quadratic": lambda n: float(n) ** 2,
}


@dataclass(frozen=True)
class Figures:
    """One path at one N (see the module docstring)."""

    ops_per_rank: float
    bytes_per_rank: float
    max_ops_per_rank: float
    aggregator_ops: float | None
    aggregator_bytes: float | None
    busiest_store_ops_per_s: float
    seconds: float

    def to_json(self, aggregator: bool) -> dict[str, object]:
        return {
            "ops_per_rank": round(self.ops_per_rank, 2), "bytes_per_rank": round(self.bytes_per_rank),
            "max_ops_per_rank": round(self.max_ops_per_rank, 2),
            "aggregator_ops": None if self.aggregator_ops is None else round(self.aggregator_ops, 2),
            "aggregator_bytes": None if self.aggregator_bytes is None else round(self.aggregator_bytes),
            "busiest_store_ops_per_s": round(self.busiest_store_ops_per_s), "seconds": round(self.seconds, 3),
            "aggregator": aggregator,
        }


def figures(ops: Mapping[int, float], nbytes: Mapping[int, float], *, seconds: float, events: float = 1.0,
            aggregators: Sequence[int] = ()) -> Figures:
    """A phase's per-rank counts as figures per event (`events`: looks, heartbeats, votes the phase
    held); `aggregators`: the ranks that aggregate (their figures are apart, not in the median)."""
    events = max(events, 1e-9)
    ranks = [rank for rank in ops if rank not in aggregators] or list(ops)
    own = [ops[rank] / events for rank in ranks]
    gathered = [ops[rank] / events for rank in aggregators if rank in ops]
    gathered_bytes = [nbytes.get(rank, 0) / events for rank in aggregators if rank in ops]
    total = sum(ops.values())
    return Figures(
        ops_per_rank=statistics.median(own) if own else 0.0,
        bytes_per_rank=statistics.median([nbytes.get(rank, 0) / events for rank in ranks]) if ranks else 0.0,
        max_ops_per_rank=max(own, default=0.0),
        aggregator_ops=max(gathered) if gathered else None,
        aggregator_bytes=max(gathered_bytes) if gathered_bytes else None,
        busiest_store_ops_per_s=total / seconds if seconds > 0 else 0.0,
        seconds=seconds,
    )


def _residual(sizes: Sequence[int], values: Sequence[float], shape: str) -> float:
    xs = [_SHAPES[shape](n) for n in sizes]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(values)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = 0.0 if spread == 0 else sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, values)) / spread
    if shape != "constant" and slope < 0:
        slope = 0.0  # a shrinking series is not growth
    intercept = mean_y - slope * mean_x
    return sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, values))


def growth(series: Mapping[int, float]) -> str:
    """The growth class of `series` (N -> figure); "constant" for fewer than three points that do not
    grow, else the simplest model that fits (see the module docstring)."""
    sizes = sorted(series)
    values = [float(series[n]) for n in sizes]
    if len(sizes) < 2 or max(values) - min(values) <= 1e-9 + 0.05 * max(abs(v) for v in values):
        return "constant"
    if len(sizes) == 2:  # two points: the exponent of N between them
        exponent = math.log(max(values[1], 1e-9) / max(values[0], 1e-9)) / math.log(sizes[1] / sizes[0])
        return "constant" if exponent < 0.15 else "log" if exponent < 0.6 else "linear" if exponent < 1.5 else "quadratic"
    residuals = {shape: _residual(sizes, values, shape) for shape in GROWTHS}
    scale = sum((v - statistics.fmean(values)) ** 2 for v in values) or 1.0
    best = min(residuals.values())
    return next(shape for shape in GROWTHS if residuals[shape] - best <= TIE * scale)


def fitted(series: Mapping[int, float], shape: str, n: int) -> float:
    """`series` extended to `n` along `shape` (least squares of `a + b f(N)`)."""
    sizes = sorted(series)
    values = [float(series[s]) for s in sizes]
    xs = [_SHAPES[shape](s) for s in sizes]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(values)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = 0.0 if spread == 0 else max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, values)) / spread)
    return mean_y - slope * mean_x + slope * _SHAPES[shape](n)


RANK = {shape: index for index, shape in enumerate(GROWTHS)}


def worst(paths: Mapping[str, Mapping[int, float]]) -> tuple[str, str] | None:
    """(path, growth) of the path whose per-rank operations grow fastest (ties: the most at the largest N)."""
    ranked = [(RANK[growth(series)], series[max(series)], name) for name, series in paths.items() if series]
    if not ranked:
        return None
    _, _, name = max(ranked)
    return name, growth(paths[name])


# -- the capacity model ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Load:
    ranks: int
    nodes: int
    failure_ops: float
    """Store operations a failure costs the job (every path of a recovery, each rank's share)."""
    failure_seconds: float
    """How long those take (the round and regroup the recovery waits for)."""
    steady_ops_per_s: float
    """Store operations per second between failures (agents' heartbeats and looks; workers: none)."""

    @property
    def failure_ops_per_s(self) -> float:
        return self.failure_ops / self.failure_seconds if self.failure_seconds > 0 else float("inf")


def capacity(ranks: int, *, ranks_per_node: int, per_rank_failure_ops: float, per_node_failure_ops: float,
             failure_seconds: float, per_node_steady_ops_per_s: float, aggregator_ops: float = 0.0) -> Load:
    """A job of `ranks` ranks: its store load from per-rank and per-node figures (see the module docstring)."""
    nodes = max(1, ranks // ranks_per_node)
    return Load(
        ranks=ranks, nodes=nodes,
        failure_ops=per_rank_failure_ops * ranks + per_node_failure_ops * nodes + aggregator_ops,
        failure_seconds=failure_seconds,
        steady_ops_per_s=per_node_steady_ops_per_s * nodes,
    )
