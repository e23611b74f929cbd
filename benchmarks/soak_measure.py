"""What one incident of the soak (one SIGKILL, or two close together) cost the job, read from its event log.

Pure functions of the event log's records (`{"event", "time", "step", "world_size", ...}`, rank 0's,
the recipe's `--events`) and of the kill times; benchmarks/soak.py calls them, and so do the unit tests
(tests/unit/test_soak.py) on records made by hand.

Definitions (issue 52):
- steady step `d`: the median gap between consecutive steps at the job's full size before the first
  kill (the last `WINDOW_STEPS` of them); the steady rate is the full size's samples per step over `d`.
- the window: from the last step completed before the first kill (`begin`) to the moment the job is
  steady again at its full size (`end`): the start of the first run of `STEADY_STEPS` consecutive
  steps at the full size, each no longer than `STEADY_SLACK` x `d`, after a recovery (a group
  started, healed or grown after the kill).
- steps redone: from the restore events in the window (`redone`, or the newest completed step less
  the restored one when the runtime has no figure).
- stall: the longest gap between two steps in the window (from `begin`), less `d`.
- time lost: the window's length, less the samples trained in it that were not redone divided by
  the steady rate: in full-size steps, `end - begin - d * sum(world_size / full)` over the steps past
  the newest one completed before the kill (each counted once, at the size it was last trained at).
  Redone steps, slow first steps, join pauses and smaller-world steps all count.
- path: how the job came back: `heal` (a live member's state: a heal in place, a shrink or a grow),
  `round` (a new rendezvous round restored from memory, a peer or the disk, or started over), in the
  order they happened; `sources` the restores' sources.

A step's event is written one step late by rank 0, so a killed rank 0 never logs its last step; the
restore that follows says how far the job had come (its step plus `redone`), and that step counts as
completed a steady step after the last one logged.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

WINDOW_STEPS = 10
"""Steps before a kill the steady step is measured on."""
STEADY_STEPS = 3
"""Consecutive full-size steps of a steady step's length that end a window."""
STEADY_SLACK = 1.5
"""How much longer than the steady step a step may take and still count as steady."""
JITTER_S = 0.05
RECOVERY_EVENTS = ("start", "heal", "restore")


@dataclass
class Incident:
    """One incident's figures (see the module docstring); `None` fields: not measurable (never steady again)."""

    kind: str
    kills: list[dict[str, Any]]
    """Each SIGKILL: `time` (unix), `rank`, `node` (agent index) and `hit` (the moment actually hit)."""
    steady_step_s: float
    begin: float
    end: float | None = None
    stall_s: float | None = None
    time_lost_s: float | None = None
    redone: int = 0
    redone_estimated: bool = False
    path: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    time_line: list[str] = field(default_factory=list)

    @property
    def recovered(self) -> bool:
        return self.end is not None

    def over_bound(self, stall_bound: float, lost_bound: float) -> bool:
        return not self.recovered or (self.stall_s or 0.0) > stall_bound or (self.time_lost_s or 0.0) > lost_bound

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "kills": self.kills, "steady_step_s": self.steady_step_s, "begin": self.begin,
                "end": self.end, "stall_s": self.stall_s, "time_lost_s": self.time_lost_s, "redone": self.redone,
                "redone_estimated": self.redone_estimated, "path": self.path, "sources": self.sources,
                "time_line": self.time_line}


def steps_of(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted((r for r in records if r.get("event") == "step"), key=lambda r: r["time"])


def steady_step(records: list[dict[str, Any]], before: float, full: int) -> float | None:
    """The median gap between consecutive full-size steps among the last `WINDOW_STEPS` before `before`."""
    steps = [r for r in steps_of(records) if r["time"] <= before][-(WINDOW_STEPS + 1):]
    gaps = [b["time"] - a["time"] for a, b in zip(steps, steps[1:])
            if b["step"] == a["step"] + 1 and a["world_size"] == b["world_size"] == full]
    return statistics.median(gaps) if len(gaps) >= 3 else None


def last_completed(records: list[dict[str, Any]], before: float) -> dict[str, Any] | None:
    """The newest step event completed by `before` (by its time)."""
    done = [r for r in steps_of(records) if r["time"] <= before]
    return done[-1] if done else None


def steady_again(records: list[dict[str, Any]], first_kill: float, last_kill: float, full: int,
                 d: float, past: int = 0) -> float | None:
    """The start of the first run of `STEADY_STEPS` consecutive full-size steps past step `past` (the
    job is back where it was), each at most `steady_limit(d)` long, after `last_kill` and after a
    recovery event that followed `first_kill`, with no recovery event inside it (a grow after a shrink)."""
    recoveries = sorted(r["time"] for r in records if r.get("event") in RECOVERY_EVENTS and r["time"] > first_kill)
    if not recoveries:
        return None
    steps = [r for r in steps_of(records) if r["time"] > max(last_kill, recoveries[0])]
    while steps and steps[0]["step"] <= past:  # steps redone: not back where it was yet
        steps.pop(0)
    for i in range(len(steps) - STEADY_STEPS):
        run = steps[i:i + STEADY_STEPS + 1]
        if any(run[0]["time"] - d < t <= run[-1]["time"] for t in recoveries):
            continue
        if all(r["world_size"] == full for r in run) and all(
                b["step"] == a["step"] + 1 and b["time"] - a["time"] <= steady_limit(d) for a, b in zip(run, run[1:])):
            return run[0]["time"]
    return None


def steady_limit(d: float) -> float:
    """The longest a steady step may take: `STEADY_SLACK` x `d`, and at least `JITTER_S` more than `d`
    (a small model's steps of tens of milliseconds jitter by more than half a step)."""
    return max(STEADY_SLACK * d, d + JITTER_S)


def redone_steps(records: list[dict[str, Any]], begin: float, end: float, newest: int) -> tuple[int, bool]:
    """Steps the restores in (begin, end] made the job train again: their `redone`, else `newest` less
    the restored step; (steps, whether any was estimated). A live restore (a heal) redoes none."""
    redone, estimated = 0, False
    for r in records:
        if r.get("event") != "restore" or not begin < r["time"] <= end:
            continue
        if "redone" in r:
            redone += int(r["redone"])
        else:
            redone += max(0, newest - int(r["step"]))
            estimated = True
    return redone, estimated


def newest_completed(records: list[dict[str, Any]], begin: float, end: float, logged: int) -> int:
    """The newest step completed before the kill: the newest logged one, or more when a restore in
    the window says so (its step plus `redone`: rank 0 died before it logged its last step)."""
    said = [int(r["step"]) + int(r.get("redone", 0)) for r in records
            if r.get("event") == "restore" and begin < r["time"] <= end and r.get("source") != "none"]
    first = min(said, default=logged)  # the first restore after the kill speaks of the kill
    return max(logged, first)


def path_of(records: list[dict[str, Any]], begin: float, end: float) -> tuple[list[str], list[str]]:
    """How the job came back in (begin, end]: `heal`/`shrink`/`grow` (heal events), `round` (a restore
    that was not live, or a group started without one), in order; and the restores' sources."""
    path: list[str] = []
    sources: list[str] = []
    for r in sorted(records, key=lambda r: r["time"]):
        if not begin < r["time"] <= end:
            continue
        kind = r.get("event")
        if kind == "heal":
            path.append(str(r.get("change", "heal")))
        elif kind == "restore":
            source = str(r.get("source", "disk"))
            sources.append(source)
            if source == "live":  # a heal's own event says which (a replacement at rank 0 writes none)
                if not any(x.get("event") == "heal" and abs(x["time"] - r["time"]) < 2.0 for x in records):
                    path.append("heal")
            else:
                path.append("round")
        elif kind == "start":  # a group started: its restore (just before) said which way; none: started over
            if not any(x.get("event") == "restore" and r["time"] - 2.0 < x["time"] <= r["time"] for x in records):
                path.append("round")
    return path, sources


def measure(records: list[dict[str, Any]], *, kind: str, kills: list[dict[str, Any]], full: int,
            d: float) -> Incident:
    """The incident of `kills` (their `time`s, first first) in a job of `full` workers, steady step `d`."""
    first = kills[0]["time"]
    last = last_completed(records, first)
    begin = last["time"] if last is not None else first
    logged = last["step"] if last is not None else 0
    incident = Incident(kind=kind, kills=kills, steady_step_s=d, begin=begin)
    newest = newest_completed(records, begin, float("inf"), logged)
    end = steady_again(records, first, kills[-1]["time"], full, d, past=newest)
    horizon = end if end is not None else max((r["time"] for r in records), default=first)
    incident.redone, incident.redone_estimated = redone_steps(records, begin, horizon, newest)
    incident.path, incident.sources = path_of(records, first, horizon)
    if end is None:
        return incident
    incident.end = end
    steps = [r for r in steps_of(records) if begin < r["time"] <= end]
    times = [begin, *(r["time"] for r in steps)]
    if newest > logged:  # rank 0's last step before the kill, never logged: it ended about a steady step later
        times.append(begin + d)
    times.sort()
    incident.stall_s = max((b - a for a, b in zip(times, times[1:])), default=0.0) - d
    kept: dict[int, int] = {}
    for r in steps:  # each step past the newest completed counts once, at the size it was last trained at
        if r["step"] > newest:
            kept[r["step"]] = r["world_size"]
    done_before = newest - logged  # the unlogged step(s) rank 0 completed before it died count as trained
    trained = sum(size / full for size in kept.values()) + done_before
    incident.time_lost_s = (end - begin) - d * trained
    return incident


def time_line(records: list[dict[str, Any]], lines: list[tuple[float, str]], incident: Incident,
              *, limit: int = 40) -> list[str]:
    """What happened in the incident's window, in seconds after its first kill: each kill, the events
    (not the steps: their count and span), and the agents' and workers' lines (`lines`: (time, text))."""
    zero = incident.kills[0]["time"]
    end = incident.end if incident.end is not None else max((r["time"] for r in records), default=zero)
    out: list[tuple[float, str]] = [(k["time"], f"SIGKILL rank {k['rank']} (node {k['node']}, {k['hit']})")
                                    for k in incident.kills]
    for r in records:
        if incident.begin <= r["time"] <= end and r.get("event") != "step":
            fields = {k: v for k, v in r.items() if k in ("step", "world_size", "source", "change", "seconds", "redone",
                                                          "rank", "exitcode", "error")}
            out.append((r["time"], f"{r['event']} {fields}"))
    steps = [r for r in steps_of(records) if incident.begin <= r["time"] <= end]
    for a, b in zip(steps, steps[1:]):
        if b["time"] - a["time"] > steady_limit(incident.steady_step_s):
            out.append((b["time"], f"step {b['step']} at world size {b['world_size']}, "
                                   f"{b['time'] - a['time']:.2f} s after step {a['step']}"))
    out += [(t, text[:200]) for t, text in lines if incident.begin - 1 <= t <= end]
    out.sort(key=lambda pair: pair[0])
    rendered = [f"{t - zero:+8.2f} s  {text}" for t, text in out]
    return rendered if len(rendered) <= limit else rendered[:limit // 2] + ["..."] + rendered[-limit // 2:]


def summary(incidents: list[Incident], *, stall_bound: float = 3.0) -> dict[str, Any]:
    """Per setting: median, p99 and max of stall and time lost, steps redone, paths, and the incidents
    over the bound (a stall over `stall_bound` s, time lost over twice the median, or never steady again)."""
    stalls = [i.stall_s for i in incidents if i.stall_s is not None]
    lost = [i.time_lost_s for i in incidents if i.time_lost_s is not None]
    median_lost = statistics.median(lost) if lost else None
    bound = 2 * median_lost if median_lost is not None and median_lost > 0 else float("inf")
    paths: dict[str, int] = {}
    for i in incidents:
        key = "+".join(i.path) or "none"
        paths[key] = paths.get(key, 0) + 1
    return {
        "incidents": len(incidents),
        "kills": sum(len(i.kills) for i in incidents),
        "unrecovered": sum(not i.recovered for i in incidents),
        "stall_s": quantiles(stalls),
        "time_lost_s": quantiles(lost),
        "redone": {"mean": statistics.fmean(i.redone for i in incidents) if incidents else None,
                   "max": max((i.redone for i in incidents), default=None)},
        "paths": paths,
        "over_bound": [n for n, i in enumerate(incidents) if i.over_bound(stall_bound, bound)],
    }


def quantiles(values: list[float]) -> dict[str, float | None]:
    """Median, p99 (nearest rank) and max."""
    if not values:
        return {"median": None, "p99": None, "max": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, max(0, -(-99 * len(ordered) // 100) - 1))]
    return {"median": statistics.median(ordered), "p99": p99, "max": ordered[-1]}


def recovered_after(records: list[dict[str, Any]], after: float) -> bool:
    """Whether a recovery event (a group started, healed or grown; a restore) was written after `after`."""
    return any(r.get("event") in RECOVERY_EVENTS and r["time"] > after for r in records)
