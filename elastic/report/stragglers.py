"""Slow ranks, read back from a job's event log: one line per episode for `python -m elastic.report`, and
the spans the run's picture shades on the throughput against wall time.

The workers write these events (elastic._worker.observe.slow_ranks): `straggler` (rank, node, host,
slowdown: its work per sample over the other ranks' median, step) when an episode starts, and
`straggler_recovered` (the same fields) when it ends; `straggler_evicted` (also action, reason) when
`--slow-ranks evict` names it, which ends the episode when the rank left (action `evicted`).

Invariant: a field of the wrong type (a log edited or torn by hand) is shown as "?", never an exception;
an episode whose times are not numbers is drawn nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KINDS = ("straggler", "straggler_recovered", "straggler_evicted")


def _number(value: Any) -> str:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else "?"


def _text(value: Any) -> str:
    return value if isinstance(value, str) and value else "?"


def _slowdown(value: Any) -> str:
    return f"{value:.2f}x" if isinstance(value, (int, float)) and not isinstance(value, bool) else "?"


def describe(event: dict[str, Any]) -> str | None:
    """One line for a `straggler` or `straggler_recovered` event; None for another kind."""
    kind = event.get("event")
    if kind not in KINDS:
        return None
    who = (f"rank {_number(event.get('rank'))} on node {_text(event.get('node'))} "
           f"(host {_text(event.get('host'))})")
    if kind == "straggler":
        return (f"straggler from step {_number(event.get('step'))}: {who}, {_slowdown(event.get('slowdown'))} "
                "the other ranks' work per sample")
    if kind == "straggler_evicted":
        return (f"straggler {_text(event.get('action'))} at step {_number(event.get('step'))}: {who}, "
                f"{_text(event.get('reason'))}")
    return f"straggler recovered at step {_number(event.get('step'))}: {who}, {_slowdown(event.get('slowdown'))}"


def lines(events: list[dict[str, Any]]) -> list[str]:
    """One line per straggler event, in order."""
    return [line for line in map(describe, events) if line is not None]


@dataclass(frozen=True)
class Episode:
    rank: int
    start_time: float
    end_time: float | None
    """None: the log ends while the rank is still slow."""


def episodes(events: list[dict[str, Any]]) -> list[Episode]:
    """Each rank's straggler episodes, in the order they started (an unended one lasts to the log's end)."""
    open_since: dict[int, float] = {}
    found: list[Episode] = []
    for event in events:
        rank, time = event.get("rank"), event.get("time")
        if not isinstance(rank, int) or isinstance(rank, bool) or not isinstance(time, (int, float)):
            continue
        if event.get("event") == "straggler" and rank not in open_since:
            open_since[rank] = float(time)
        elif rank in open_since and (event.get("event") == "straggler_recovered" or (
                event.get("event") == "straggler_evicted" and event.get("action") == "evicted")):
            found.append(Episode(rank, open_since.pop(rank), float(time)))
    found += [Episode(rank, start, None) for rank, start in open_since.items()]
    return sorted(found, key=lambda e: e.start_time)
