"""The verdict on a chaos job: what it must show (`ScenarioResult`), how long it took to recover,
whether its final checkpoint is committed and verifies, and its picture.

A scenario (elastic.chaos.scenarios) is judged on its exit codes, the step it
ended at, a recovery after every fault, the exactly-once audit of its samples
and, where the scenario promises them, the steps redone per fault and the
workers that kept their processes. A recovery is the first step completed by a
worker group that started (a "start" event) or healed in place (a "heal" event:
TORCHREVIVE_SURVIVORS=keep) after the fault; its times are unix times, from the
event log and from torch's lines in the agents' logs (read as this year's).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from elastic._shared.common.errors import CorruptCheckpoint
from elastic._shared.storage.directory import CheckpointStore
from elastic.chaos.samples import SampleAudit

logger = logging.getLogger(__name__)

# torch's log lines: "I1123 06:10:31.355000 2706 path/file.py:942] message"
_TORCH_LOG_LINE = re.compile(r"^[IWE](?P<date>\d{4}) (?P<time>\d\d:\d\d:\d\d\.\d+) \d+ \S+\] (?P<message>.*)$", re.MULTILINE)


@dataclass
class ScenarioResult:
    scenario: str
    exit_codes: list[int | None]
    expected_codes: list[int | None]
    end_step: int | None
    max_steps: int
    recovery_seconds: list[float | None]
    final_checkpoint: str | None
    checkpoint_error: str | None
    samples: SampleAudit
    logs: str
    report: Path | None = None
    """The run's picture (`elastic.report`), when matplotlib is installed."""
    stops_at: int | None = None
    """For a job meant to stop rather than finish: the step of the checkpoint it must leave intact."""
    redone: list[int] = field(default_factory=list)
    """Per restore after a fault: steps finished before it that the job trained again."""
    max_redone: int | None = None
    """The most steps a fault may cost (None: not judged, e.g. under stock torchrun: no snapshots)."""
    kept_processes: int = 0
    """Worker processes that trained in every group of the run (`elastic.chaos.samples.kept_processes`)."""
    min_kept: int | None = None
    """The fewest that must have (TORCHREVIVE_SURVIVORS=keep or train-on); None: not judged."""

    @property
    def kept_ok(self) -> bool:
        return self.min_kept is None or self.kept_processes >= self.min_kept

    @property
    def redone_ok(self) -> bool:
        return self.max_redone is None or all(r <= self.max_redone for r in self.redone)

    @property
    def samples_ok(self) -> bool:
        """Every step 1..max_steps survived once and used each sample of an epoch once
        (up to where the job stopped, for one meant to stop)."""
        if self.stops_at is not None:
            return self.samples.ok and self.samples.first_step == 1
        return self.samples.ok and (self.samples.first_step, self.samples.last_step) == (1, self.max_steps)

    @property
    def ok(self) -> bool:
        return (
            self.exit_codes == self.expected_codes
            and self.end_step == (self.max_steps if self.stops_at is None else None)
            and self.final_checkpoint is not None
            and all(r is not None for r in self.recovery_seconds)
            and self.samples_ok
            and self.redone_ok
            and self.kept_ok
        )

    def summary(self) -> str:
        recoveries = ", ".join("none" if r is None else f"{r:.1f} s" for r in self.recovery_seconds) or "-"
        verdict = "ok" if self.ok else "FAILED"
        return (
            f"{self.scenario}: {verdict}; exit codes {self.exit_codes} (expected {self.expected_codes}); "
            f"ended at step {self.end_step}/{self.max_steps}; recovery {recoveries}; "
            f"steps redone {self.redone or '-'}" + (f" (at most {self.max_redone})" if self.max_redone is not None else "") + "; "
            + (f"workers that kept their process {self.kept_processes} (at least {self.min_kept}); "
               if self.min_kept is not None else "")
            + f"final checkpoint {self.final_checkpoint or self.checkpoint_error}; {self.samples.summary()}"
            + (f"; picture {self.report}" if self.report else "")
        )


def draw_report(events: Path, out: Path, *, title: str) -> Path | None:
    """Draw the job's picture; None when it cannot be drawn (no matplotlib, no step ran)."""
    from elastic._shared.common.errors import UsageError
    from elastic.report import load_events, render

    try:
        render(load_events(events), out, title=title)
    except UsageError as exc:  # no matplotlib, or nothing to draw
        logger.info("no report for %s: %s", events, exc)
        return None
    except Exception:  # noqa: BLE001 - a drawing bug must not fail the scenario it would illustrate
        logger.warning("drawing the report of %s failed", events, exc_info=True)
        return None
    return out


def verified_final_checkpoint(directory: Path, step: int) -> tuple[str | None, str | None]:
    """(name, None) when the checkpoint of `step` is committed and verifies, else (None, why)."""
    store = CheckpointStore(directory)
    for candidate in store.committed():
        try:
            manifest = store.verify(candidate)
        except CorruptCheckpoint as exc:
            return None, f"corrupt: {exc}"
        if manifest.step == step:
            return candidate.path.name, None
    return None, f"no verified checkpoint of step {step} in {directory}"


def recovery_seconds(records: list[dict[str, Any]], fault_time: float) -> float | None:
    """Fault -> first step completed by a worker group that started after it, or that healed in
    place after it; None when there is none yet."""
    resumed_from = None  # the step the group went on from (its "start" or "heal" event's)
    for record in records:
        if record["time"] <= fault_time:
            continue
        if record["event"] in ("start", "heal"):
            resumed_from = record["step"]
        # A step's line may be written after the heal's (one step late) yet finished before it.
        elif record["event"] == "step" and resumed_from is not None and record["step"] > resumed_from:
            return record["time"] - fault_time
    return None


def recovery_phases(records: list[dict[str, Any]], logged: list[tuple[float, str]],
                    fault_time: float) -> dict[str, float] | None:
    """Where a recovery's time went, in seconds after the fault: `detected` (an agent
    decided to restart its workers), `rendezvous` (the new round's workers start),
    `restored` (rank 0 reloaded the checkpoint: its 'start' event) and `step` (the
    first step). From torch's lines in the agents' logs (`logged`, as `torch_log_times`
    reads them) and the event log's `records`."""
    step = recovery_seconds(records, fault_time)
    if step is None:
        return None
    restart = [t for t, what in logged if t > fault_time and "will restart worker group" in what]
    started = [t for t, what in logged if restart and t > restart[0] and "Starting worker group" in what]
    restored = [r["time"] for r in records if r["event"] == "start" and r["time"] > fault_time]
    if not (restart and started and restored):
        return None
    return {
        "detected": min(restart) - fault_time,
        "rendezvous": min(started) - fault_time,
        "restored": restored[0] - fault_time,
        "step": step,
    }


def torch_log_times(logs: Iterable[str]) -> list[tuple[float, str]]:
    """(unix time, line) of every timestamped line torch logged in `logs` (the agents' logs' texts), in order."""
    year = time.localtime().tm_year
    found = []
    for text in logs:
        for match in _TORCH_LOG_LINE.finditer(text):
            stamp = datetime.strptime(f"{year}{match['date']} {match['time']}", "%Y%m%d %H:%M:%S.%f")
            found.append((stamp.timestamp(), match["message"]))
    return sorted(found)
