"""Runs one save at a time off the training loop.

Invariants:
- At most one job is in flight: `submit` first waits for the previous one.
- A job's exception is never lost: it is raised by the next `submit` or
  `wait`, in the loop's thread.
- The thread is not a daemon: the interpreter does not exit (normally, or
  after an exception in the loop) while a save is half done.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class BackgroundWriter:
    def __init__(self, name: str = "checkpoint-writer") -> None:
        self._name = name
        self._thread: threading.Thread | None = None
        self._result: Any = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Callable[[], Any]) -> Any:
        """Start `job` on the writer thread; returns the previous job's result."""
        previous = self.wait()
        self._result, self._error = None, None

        def run() -> None:
            try:
                self._result = job()
            except BaseException as exc:  # re-raised in the loop's thread
                self._error = exc

        self._thread = threading.Thread(target=run, name=self._name, daemon=False)
        self._thread.start()
        return previous

    def wait(self) -> Any:
        """Wait for the job in flight (if any); return its result or raise its error."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        result, self._result = self._result, None
        if error is not None:
            raise error
        return result
