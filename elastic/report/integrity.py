"""Silent corruption and numeric faults, read back from a job's event log: one line each for
`python -m elastic.report`, and the figures a run's report gives (time to detect, steps replayed).

The workers write these events (elastic._worker.integrity): `corruption` (a replica check's mismatch:
the detection step and time, the step rolled back to, the steps replayed, the kind `transient`, `node`
or `batch`, the rank(s) and node(s) named, the action; a `batch` one also the batch: its step, epoch,
place in the epoch stream and the suspect samples) and `numeric` (a step the numeric guard caught
before its update: the value, why, the action, where its samples sit; `kind` `batch` when a step
caught under rollback was caught again on its replay).

Invariant: a field of the wrong type (a log edited or torn by hand) is shown as "?", never an exception.
"""

from __future__ import annotations

import math
from typing import Any

KINDS = ("corruption", "numeric")


def _number(value: Any) -> str:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else "?"


def _text(value: Any) -> str:
    return value if isinstance(value, str) and value else "?"


def _value(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else _number(value)


def describe(event: dict[str, Any]) -> str | None:
    """One line for a `corruption` or `numeric` event; None for another kind."""
    kind, step = event.get("event"), _number(event.get("step"))
    if kind == "corruption":
        ranks, nodes = event.get("ranks"), event.get("nodes")
        ranks = ranks if isinstance(ranks, list) else []
        nodes = nodes if isinstance(nodes, list) and len(nodes) == len(ranks) else ["?"] * len(ranks)
        named = ", ".join(f"rank {_number(r)} on {_text(n)}" for r, n in zip(ranks, nodes)) or "no rank named"
        return (f"corruption found at step {step}: {_text(event.get('kind'))} ({named}); rolled back to step "
                f"{_number(event.get('rolled_back_to'))}, {_number(event.get('steps_replayed'))} step(s) replayed: "
                f"{_text(event.get('action'))}{_batch(event.get('batch'))}")
    if kind == "numeric":
        again = " (caught again on its replay: the batch)" if event.get("kind") == "batch" else ""
        return (f"numeric fault at step {step}: {_text(event.get('why'))} ({_value(event.get('value'))}) caught "
                f"before the update: {_text(event.get('action'))}{again}")
    return None


def _batch(batch: Any) -> str:
    """A `batch` event's batch as a tail of its line: the step, epoch, positions in the stream, suspect samples."""
    if not isinstance(batch, dict):
        return ""
    indices = batch.get("indices")
    shown = ", ".join(map(_number, indices[:8])) + (", ..." if len(indices) > 8 else "") if isinstance(
        indices, list) else "?"
    consumed, count = batch.get("consumed"), batch.get("count")
    span = f"{consumed}-{consumed + count - 1}" if all(
        isinstance(v, int) and not isinstance(v, bool) for v in (consumed, count)) else "?"
    return (f"; the batch of step {_number(batch.get('step'))} (epoch {_number(batch.get('epoch'))}, "
            f"positions {span} of its stream), suspect samples [{shown}]")


def lines(events: list[dict[str, Any]]) -> list[str]:
    """One line per `corruption` and `numeric` event, in order."""
    return [line for line in map(describe, events) if line is not None]


def detection(events: list[dict[str, Any]], fault_step: int) -> tuple[int, float] | None:
    """Steps and seconds from the end of step `fault_step` (a fault made then) to the first mismatch
    found after it: (steps, seconds), or None when none was found or the step's end is not in the log."""
    ended = [e["time"] for e in events if e.get("event") == "step" and e.get("step") == fault_step
             and isinstance(e.get("time"), float)]  # the first time: a replay ends the step again later
    found = [e for e in events if e.get("event") == "corruption" and isinstance(e.get("detected_step"), int)
             and e["detected_step"] >= fault_step and isinstance(e.get("detected_time"), float)]
    if not ended or not found:
        return None
    first = min(found, key=lambda e: e["detected_time"])
    seconds = first["detected_time"] - min(ended)
    return first["detected_step"] - fault_step, seconds if math.isfinite(seconds) else math.nan
