"""What a failed save means for the job: a warning and training goes on, or a stop.

Invariants (rank 0 judges; the others learn its verdict at the next vote):
- A save that fails (full disk, quota, I/O error) is a warning, a
  `checkpoint_failed` event and a metric; training goes on. `max_failures`
  periodic failures in a row set `stop_reason` (once: later failures, until
  the ranks' vote carries it, do not change it): `elastic.Run` turns it into
  `CheckpointStorageError` (exit 75) on every rank at the step the vote is read.
- A final or preemption save that fails, or does not commit within the
  timeout, sets `fatal`: `Saver.flush` raises it on every rank.
- Every message names the newest committed checkpoint, which a failure never touches.
"""

from __future__ import annotations

import logging
from typing import Any

from elastic._shared.storage.checkpoint_storage import CheckpointStorage
from elastic._shared.storage.manifest import checkpoint_name
from elastic._worker.observe.events import EventLog
from elastic._worker.runtime.context import WorkerContext

logger = logging.getLogger(__name__)


class FailurePolicy:
    """Rank 0's account of saves: what committed, what failed, and whether the job must stop."""

    def __init__(self, ctx: WorkerContext, store: CheckpointStorage[Any], events: EventLog, *, max_failures: int) -> None:
        self._ctx = ctx
        self.store = store
        self._events = events
        self.max_failures = max_failures
        """Periodic saves that may fail in a row before the job stops (`CheckpointStorageError`)."""
        self.failures_in_a_row = 0
        self.last_save_failed = False
        """The newest save did not commit (a save at its step again is not skipped)."""
        self.stop_reason: str | None = None
        """Why the job must stop (saves keep failing); None while it may go on."""
        self.fatal: str | None = None
        """A final or preemption save that did not commit."""
        self.history: list[dict[str, float]] = []
        """Per committed save: step, seconds (start to commit), blocking_seconds."""

    def committed(self, step: int, reason: str, started: float, blocking_seconds: float, committed_at: float) -> None:
        self.failures_in_a_row = 0
        self.last_save_failed = False
        seconds = committed_at - started
        self.history.append({"step": step, "seconds": seconds, "blocking_seconds": blocking_seconds})
        self._events.emit(
            "checkpoint", step=step, world_size=self._ctx.world_size, time=committed_at,
            seconds=seconds, blocking_seconds=blocking_seconds, reason=reason,
            path=str(self.store.root / checkpoint_name(step)),
        )
        logger.debug("checkpoint at step %d committed in %.2f s", step, seconds)

    def failed(self, step: int, reason: str, error: str) -> None:
        """A save that did not commit: see the module docstring."""
        self.failures_in_a_row += reason == "periodic"
        self.last_save_failed = True
        self._events.emit(
            "checkpoint_failed", step=step, world_size=self._ctx.world_size, reason=reason,
            error=error, failures_in_a_row=self.failures_in_a_row,
        )
        newest = self.newest_committed()
        if reason != "periodic":
            self.fatal = f"the {reason} checkpoint of step {step} failed: {error}; {newest}"
            return
        if self.failures_in_a_row >= self.max_failures:
            if self.stop_reason is None:  # the reason is the failure that crossed the line, not those until the vote
                self.stop_reason = (
                    f"{self.failures_in_a_row} checkpoints in a row failed (--ckpt-max-failures), the last: {error}; "
                    f"{newest}"
                )
            return  # the next vote stops every rank; its error is the one line
        logger.warning(
            "checkpoint of step %d failed (%d of %d in a row before the job stops): %s; training goes on",
            step, self.failures_in_a_row, self.max_failures, error,
        )

    def timed_out(self, what: str, waited: float) -> str:
        """The one line for a save (`what`) that did not commit within `waited` seconds."""
        return (
            f"{what} did not commit within {waited:g} s (--ckpt-timeout): {self.store.root} is too slow "
            f"or hung; {self.newest_committed()}"
        )

    def newest_committed(self) -> str:
        try:
            committed = self.store.committed()
        except OSError:
            committed = []
        if not committed:
            return "no checkpoint was committed"
        return f"the newest committed checkpoint, {self.store.root / committed[0].name}, is intact"
