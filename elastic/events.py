"""The JSON-lines event log of a job (`--events PATH`).

Invariants:
- One JSON object per line, each with at least `event`, `time` (unix seconds),
  `step`, `world_size` and `restart` (TORCHELASTIC_RESTART_COUNT).
- The file is only ever appended to (O_APPEND, one write per line), never
  rewritten, so one file holds the whole history of a job across restarts and a
  worker killed mid-write leaves at most one torn last line, which readers skip.
- A log that cannot be created is a `UsageError` (one line); one that cannot be
  written any more (a full disk) stops being written with one warning, and
  training goes on: events are a record, not state.
- Only the main rank writes; every other rank holds a disabled log whose
  `emit` writes nothing, so recipes call it unconditionally.
- Listeners (`subscribe`) see every event on every rank, written or not: the
  metrics of each worker are fed from the same stream as the file, so the two
  cannot disagree. A listener that raises is dropped with one warning; it
  never breaks training.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from elastic.errors import UsageError

logger = logging.getLogger(__name__)

EVENT_KINDS = ("start", "step", "eval", "checkpoint", "checkpoint_failed", "checkpoint_skipped", "restore", "end")


class EventLog:
    """Appends events to `path` (None: disabled)."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        restart: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._restart = restart
        self._clock = clock
        self._fd: int | None = None
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self._path = path
        if path is not None:
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError as exc:
                raise UsageError(f"--events {path}: cannot create the event log: {exc.strerror or exc}") from None

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
            line = json.dumps(record, separators=(",", ":")) + "\n"
            try:
                os.write(self._fd, line.encode())
            except OSError as exc:  # a full disk must not stop training: the log is a record, not state
                logger.warning("event log %s: %s; no more events are written to it", self._path, exc.strerror or exc)
                self.close()
        for listener in list(self._listeners):
            try:
                listener(record)
            except Exception as exc:  # noqa: BLE001 - observers must not stop training
                self._listeners.remove(listener)
                logger.warning("event listener %r failed and is removed: %s", listener, exc)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
