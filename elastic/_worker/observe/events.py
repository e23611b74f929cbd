"""The JSON-lines event log of a job (`--events PATH`).

Invariants:
- One JSON object per line, each with at least `event`, `time` (unix seconds),
  `step`, `world_size` and `restart` (TORCHELASTIC_RESTART_COUNT).
- The file is only ever appended to (O_APPEND, whole lines per write), never
  rewritten, so one file holds the whole history of a job across restarts and a
  worker killed mid-write leaves at most one torn last line, which readers skip.
- "step" lines of a fast loop (less than `FLUSH_SECONDS` apart) are buffered
  and written together once the first of them is `FLUSH_SECONDS` old, so such
  a loop pays one write per batch, not one per step; a slower loop's lines and
  every other event are written at once, after the lines before them (the
  order in the file is the order of `emit`). A worker killed, or stalled,
  between flushes holds back at most `FLUSH_SECONDS` of step lines.
- A log that cannot be created is a `UsageError` (one line); one that cannot be
  written any more (a full disk) stops being written with one warning, and
  training goes on: events are a record, not state.
- The log is opened without following a link in its last component, and created
  readable by its owner only (it names hosts, nodes and errors).
- Only the main rank writes; every other rank holds a disabled log whose
  `emit` writes nothing, so recipes call it unconditionally. Under
  torchrevive-run the main rank also notes the log's path for its agent (in the
  notes folder it is given: `WorkerEnv.notes_dir`), which appends the job's own events
  (`hang`, `failure`, `node_excluded`, `crash_loop`) to it, whole lines alike.
- Listeners (`subscribe`) see every event on every rank, written or not: the
  metrics of each worker are fed from the same stream as the file, so the two
  cannot disagree. A listener that raises is dropped with one warning; it
  never breaks training.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from time import monotonic, perf_counter  # emit() has a parameter named time
from typing import Any

from elastic._shared.common.errors import UsageError
from elastic._shared.protocol import worker_notes
from elastic._worker.timings import FLUSH_SECONDS

logger = logging.getLogger(__name__)

EVENT_KINDS = (
    "start", "step", "eval", "checkpoint", "checkpoint_failed", "checkpoint_skipped", "restore", "heal", "end",
    "corruption", "numeric", "straggler", "straggler_recovered", "straggler_evicted", "rebalance", "hang", "failure",
    "node_excluded", "crash_loop",
)
"""`corruption`: a replica check's mismatch, undone and named (elastic._worker.integrity.replica_check);
`numeric`: a step the numeric guard caught before its update; `straggler`, `straggler_recovered`: a slow rank's
episode began or ended (elastic._worker.observe.slow_ranks); `straggler_evicted`: `--slow-ranks evict` named a
rank for eviction (`action`: evicted, or kept and rebalanced; `reason`); `rebalance`: the global batch's new
split between the ranks (`shares`, by rank). The last four are the job's, written by
torchrevive-run's agents (elastic._agent.launcher.job_watch): a named hang, a worker's failure, a node set aside, a crash loop that stopped the job."""


class EventLog:
    """Appends events to `path` (None: disabled)."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        restart: int,
        clock: Callable[[], float] = time.time,
        notes_dir: str | None = None,
    ) -> None:
        """`notes_dir`: the agent's notes folder (`WorkerEnv.notes_dir`; None: no agent takes notes)."""
        self._restart = restart
        self._notes_dir = notes_dir
        self._clock = clock
        self._fd: int | None = None
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self._path = path
        self._buffered: list[str] = []
        self._buffered_since = 0.0
        self._last_step_line = -FLUSH_SECONDS
        self.listener_seconds = 0.0
        """Seconds spent in listeners (the metrics), for the per-step cost breakdown."""
        if path is not None:
            try:
                self._fd = _open(path)
            except OSError as exc:
                raise UsageError(f"--events {path}: cannot create the event log: {exc.strerror or exc}") from None
            _note_for_agent(notes_dir, path)

    def write_to(self, path: str | os.PathLike[str] | None) -> None:
        """Write from now on to `path` (None: write nothing, listeners still see every event): a worker
        whose group changed in place (elastic._worker.survivors.views) may have become its rank 0, or stopped being it."""
        if self._fd is not None and path is not None and Path(path) == Path(self._path or ""):
            return
        self.close()
        self._path = path
        if path is not None:
            try:
                self._fd = _open(path)
            except OSError as exc:  # the log is a record, not state: training goes on without it
                logger.warning("event log %s: %s; no events are written to it", path, exc.strerror or exc)
            else:
                _note_for_agent(self._notes_dir, path)

    @property
    def enabled(self) -> bool:
        return self._fd is not None

    def subscribe(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call `listener(record)` with every event emitted from now on, in this process."""
        self._listeners.append(listener)

    def emit(self, event: str, *, step: int, world_size: int, time: float | None = None, **fields: Any) -> None:
        """Append one event; `time` defaults to now (pass it to record when a thing happened)."""
        if self._fd is None and not self._listeners:
            return
        if event not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {event!r}; expected one of {EVENT_KINDS}")
        record = {
            "event": event,
            "time": self._clock() if time is None else time,
            "step": step,
            "world_size": world_size,
            "restart": self._restart,
            **fields,
        }
        if self._fd is not None:
            self._append(json.dumps(record, separators=(",", ":")) + "\n", buffer=event == "step")
        if self._listeners:
            started = perf_counter()
            for listener in list(self._listeners):
                try:
                    listener(record)
                except Exception as exc:  # noqa: BLE001 - observers must not stop training
                    self._listeners.remove(listener)
                    logger.warning("event listener %r failed and is removed: %s", listener, exc)
            self.listener_seconds += perf_counter() - started

    def _append(self, line: str, *, buffer: bool) -> None:
        now = monotonic()
        # Only a fast loop's step lines wait: one that came a while after the last is written now.
        wait = buffer and now - self._last_step_line < FLUSH_SECONDS
        if buffer:
            self._last_step_line = now
        if not self._buffered:
            self._buffered_since = now
        self._buffered.append(line)
        if not wait or now - self._buffered_since >= FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        """Write the buffered step lines now."""
        if self._fd is None or not self._buffered:
            return
        data, self._buffered = "".join(self._buffered).encode(), []
        try:
            while data:  # a regular file takes it whole; a short write is finished, never dropped
                data = data[os.write(self._fd, data):]
        except OSError as exc:  # a full disk must not stop training: the log is a record, not state
            logger.warning("event log %s: %s; no more events are written to it", self._path, exc.strerror or exc)
            self._close_fd()

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        self.flush()
        self._close_fd()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _note_for_agent(directory: str | None, path: str | os.PathLike[str]) -> None:
    """Tell this node's agent where the log is, when it takes notes (torchrevive-run)."""
    if directory:
        worker_notes.note_events_path(directory, path)


def _open(path: str | os.PathLike[str]) -> int:
    """The log's descriptor, for appending (see the module docstring); OSError when it cannot be one."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(exc.errno, "it is a symbolic link: the log is never written through one") from None
        raise


def read_events(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield the events of a log in order, skipping a torn (killed mid-write) line."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                logger.warning("%s:%d: skipping a torn event line", path, number)
