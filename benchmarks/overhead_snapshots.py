"""The in-memory snapshots' part of benchmarks/overhead.py: what a snapshot costs the loop, two ways.

- End to end: the recipe with snapshots on and off (both serving metrics), paired block by block:
  the seconds per step the snapshots added, as a share of a step without them. overhead.py's
  loops drain each snapshot at the end of their turns and charge the wait to that turn's step,
  so this is an upper bound: as if the snapshot thread never overlapped the next step.
- The runtime's own account, per snapshot, as `--snapshot-every auto` budgets it
  (elastic._worker.checkpoint.snapshot_costs): the loop's capture at the step boundary, its waits
  for the snapshot (not the benchmark's drains), the write's CPU time on the snapshot thread
  (copy, checksums, header), their sum against a step, and per step at the interval the run used.

And the exposure: from a step's end to its snapshot's commit a worker's death restores the step
before, so one finished step is redone; its median share of a step is the share of kills at
random moments that redo one (the rest redo none).

`summarize` runs in the worker (rank 0's snapshots of one loop); `lines` and `figures` in the
benchmark's process, on what the workers handed back.
"""

from __future__ import annotations

import statistics
from typing import Any

FIELDS = ("capture_seconds", "waited_seconds", "cpu_seconds", "seconds", "replica_seconds", "exposed_seconds",
          "write_seconds")


def summarize(memories: list[Any]) -> list[dict[str, Any]]:
    """Per `MemorySnapshots` of one loop (a run builds one per restore): its snapshots' medians over the
    records kept, skipping the first two (they make the slots), and what it made and chose."""
    out = []
    for memory in memories:
        records = [r for r in list(memory.costs.records)[2:] if r.written]
        medians = {f: statistics.median(getattr(r, f) for r in records) if records else None for f in FIELDS}
        out.append({"snapshots": memory.costs.taken, "measured": len(records), "every": memory.every,
                    "allocations": memory.allocations, "slot_bytes": memory.slot_bytes, "disabled": memory.disabled,
                    **medians})
    return out


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds is not None else "-"


def _share(seconds: float | None, step: float) -> str:
    return f"{seconds / step:.2%}" if seconds is not None else "-"


def _copy(seconds: float | None, step: float) -> str:
    """The copy to the peer node's cost, when there is one (a job on several nodes)."""
    return f"; its copy to the peer node {_ms(seconds)} CPU, {_share(seconds, step)}" if seconds else ""


def figures(results: dict[str, Any], loops: tuple[str, ...], step_s: float, on_off: tuple[float, float, float] | None
            ) -> dict[str, Any]:
    """What the lines say, as numbers: per loop with snapshots, rank 0's medians and their shares of a
    step without snapshots (`step_s`); end to end, the seconds per step snapshots added and its 95 % interval."""
    out: dict[str, Any] = {"step_without_snapshots_s": step_s}
    for name in loops:
        memories = results["snapshots"].get(name, [])
        if memories:
            newest = memories[-1]
            every = newest["every"] or 1
            out[name] = {**newest, "share_per_snapshot": (newest["seconds"] or 0.0) / step_s,
                         "share_per_step": (newest["seconds"] or 0.0) / every / step_s,
                         "exposed_share": (newest["exposed_seconds"] or 0.0) / step_s}
    if on_off is not None:  # a ratio of rates: on / off = step_off / step_on
        out["end_to_end"] = {"added_s": step_s * (1 / on_off[0] - 1), "added_low_s": step_s * (1 / on_off[2] - 1),
                             "added_high_s": step_s * (1 / on_off[1] - 1), "share": 1 / on_off[0] - 1}
    return out


def lines(label: str, results: dict[str, Any], loops: tuple[str, ...], step_s: float,
          on_off: tuple[float, float, float] | None) -> list[str]:
    """The report's lines on snapshots (`label`: the setting, e.g. "snapshots auto (every 1 steps at the end)")."""
    got = figures(results, loops, step_s, on_off)
    out = []
    for name in loops:
        f = got.get(name)
        if f is None:
            out.append(f"{name}: no snapshots measured")
            continue
        off = f" (TURNED OFF: {f['disabled']})" if f["disabled"] else ""
        out.append(
            f"{label}, {name}{off}: {f['snapshots']} taken on rank 0; per snapshot (median of {f['measured']}): "
            f"capture {_ms(f['capture_seconds'])} + waits {_ms(f['waited_seconds'])} + write CPU "
            f"{_ms(f['cpu_seconds'])} = {_ms(f['seconds'])}, {_share(f['seconds'], step_s)} of a "
            f"{step_s * 1e3:.0f} ms step; every {f['every']} step(s): {f['share_per_step']:.2%} per step "
            f"(auto's budget: 1 %){_copy(f['replica_seconds'], step_s)}; write {_ms(f['write_seconds'])} wall; "
            f"{f['allocations']} buffers made in all"
        )
        out.append(
            f"{name}: a kill between a step's end and its snapshot's commit redoes that step: median "
            f"{_ms(f['exposed_seconds'])}, {f['exposed_share']:.2%} of a step (the share of random kills that redo one)"
        )
    if on_off is not None:
        e = got["end_to_end"]
        out.append(
            f"snapshot cost per step, end to end (snapshots on / off, paired, drained at every turn: an upper "
            f"bound): {e['added_s'] * 1e3:.2f} ms [95% CI {e['added_low_s'] * 1e3:.2f}-{e['added_high_s'] * 1e3:.2f}], "
            f"{e['share']:.2%} of a step"
        )
    return out
