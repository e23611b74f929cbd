"""Runs one save at a time off the training loop, on one long-lived thread.

Invariants:
- At most one job is in flight: `submit` first waits for the previous one.
- A job's exception is never lost: it is raised by the next `submit` or
  `wait`, in the caller's thread.
- The process does not exit with a job half done: an atexit hook waits for
  the job in flight, on a normal exit and after an uncaught exception alike,
  for at most `drain_timeout` seconds (a hung filesystem must not hang the exit).
  (SIGKILL cannot be helped; the commit protocol makes it harmless.)
- Nor does the interpreter finalize while the thread runs (a save is torch C++:
  DCP writes, gloo collectives, which a finalizing interpreter unwinds into an
  abort): the thread is an `elastic._shared.common.threads` one, stopped after its job and
  joined at exit within that module's bound, past which the process ends
  without finalizing. `close` joins it unless a job overran its `timeout`.
"""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable
from typing import Any

from elastic._shared.common import threads


class _Job:
    def __init__(self, work: Callable[[], Any]) -> None:
        self.work = work
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.work()
        except BaseException as exc:  # re-raised in the caller's thread
            self.error = exc
        finally:
            self.done.set()


class BackgroundWriter:
    def __init__(self, name: str = "checkpoint-writer", *, drain_timeout: float | None = None) -> None:
        self._name = name
        self.drain_timeout = drain_timeout
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._job: _Job | None = None
        atexit.register(self._drain)

    @property
    def busy(self) -> bool:
        return self._job is not None and not self._job.done.is_set()

    def submit(self, work: Callable[[], Any]) -> Any:
        """Start `work` on the writer thread; returns the previous job's result."""
        previous = self.wait()
        if self._thread is None:
            self._thread = threads.start(self._serve, name=self._name, stop=lambda: self._jobs.put(None))
        self._job = _Job(work)
        self._jobs.put(self._job)
        return previous

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for the job in flight (if any); return its result or raise its error.

        With a `timeout`, `TimeoutError` if it is still running then; it stays in flight.
        """
        job = self._job
        if job is None:
            return None
        if not job.done.wait(timeout):
            raise TimeoutError(f"the job in flight is still running after {timeout:g} s")
        self._job = None
        if job.error is not None:
            raise job.error
        return job.result

    def close(self, timeout: float | None = None) -> None:
        """Finish the job in flight and stop the thread (raises that job's error).

        With a `timeout`, a job still running then is left to the thread
        (`TimeoutError`); the thread stops after it, and the exit joins it.
        """
        try:
            self.wait(timeout)
        finally:
            if self._thread is not None:
                self._jobs.put(None)
                if not self.busy:
                    self._thread.join()
                self._thread = None
            atexit.unregister(self._drain)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job.run()

    def _drain(self) -> None:
        if self._job is not None:
            self._job.done.wait(self.drain_timeout)
