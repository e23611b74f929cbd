"""The verdict on a chaos job: what it must show (`ScenarioResult`), whether its final checkpoint
is committed and verifies, and its picture.

A scenario (elastic.chaos.scenarios) is judged on its exit codes, the step it
ended at, a recovery after every fault, the exactly-once audit of its samples
and, where the scenario promises them, the steps redone per fault and the
workers that kept their processes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from elastic._shared.common.errors import CorruptCheckpoint
from elastic._shared.storage.directory import CheckpointStore
from elastic.chaos.samples import SampleAudit

logger = logging.getLogger(__name__)


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
