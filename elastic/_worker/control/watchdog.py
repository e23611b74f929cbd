"""Hang detection: a worker whose training makes no progress exits so torchrun can act.

torchrun restarts a worker group when a worker *exits*; a worker stuck in a
collective whose peer is gone (or SIGSTOPped, or deadlocked) never exits on its
own before the collective timeout, and with NCCL it may never exit at all. The
watchdog is a daemon thread that the training loop feeds once per step. When no
step completes for `timeout` seconds it prints one line naming the last step and
the time waited, dumps every thread's Python stack to stderr (where the worker
was stuck), and ends the process with `EXIT_CODE` through `os._exit`, the only
exit that works while the main thread is blocked inside C++. Its thread is an
`elastic._shared.common.threads` one: `close` (or the exit) stops and joins it.

Invariants: the watchdog is disarmed until the first `beat()` (restore and the
first step may be slow: compilation, data loading), and `paused()` suspends it
around work that legitimately takes longer than a step (validation, a final
checkpoint flush).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from elastic._shared.common import threads

logger = logging.getLogger(__name__)

# Distinct from a crash (1), a usage error (2) and preemption (143), so the
# event log and the agent's failure summary tell a hang apart.
EXIT_CODE = 124


class Watchdog:
    """Exits the process when `beat()` is not called for `timeout` seconds."""

    def __init__(
        self,
        timeout: float,
        *,
        on_trip: Callable[[str], None] | None = None,
        poll: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`on_trip` gets the message (default: print it, dump the stacks, exit);
        `poll` is how often the thread looks; `clock` is the time source (tests
        pass a fake one and call `check()` themselves)."""
        if timeout <= 0:
            raise ValueError("watchdog timeout must be positive")
        self.timeout = timeout
        self._on_trip = on_trip or _exit_process
        self._poll = poll if poll is not None else min(1.0, timeout / 10)
        self._clock = clock
        self._lock = threading.Lock()
        self._last_beat: float | None = None  # None: disarmed
        self._last_step: int | None = None
        self._pauses = 0
        self._stop = threading.Event()
        self.tripped = False
        self._thread = threads.start(self._watch, name="elastic-watchdog", stop=self._stop.set)

    def beat(self, step: int) -> None:
        """The loop completed `step`; cheap enough to call every step."""
        with self._lock:
            self._last_beat = self._clock()
            self._last_step = step

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No trip inside this block; the clock restarts when it ends."""
        with self._lock:
            self._pauses += 1
        try:
            yield
        finally:
            with self._lock:
                self._pauses -= 1
                if self._last_beat is not None:
                    self._last_beat = self._clock()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _watch(self) -> None:
        while not self._stop.wait(self._poll):
            if self.check():
                return

    def check(self) -> bool:
        """One look, as the thread takes every `poll` seconds: trips (once) when
        armed, not paused and `timeout` has passed since the last beat; returns
        whether it has tripped."""
        with self._lock:
            if self.tripped:
                return True
            if self._last_beat is None or self._pauses:
                return False
            waited = self._clock() - self._last_beat
            step = self._last_step
            if waited < self.timeout:
                return False
            self.tripped = True
        self._on_trip(
            f"watchdog: no training step completed for {waited:.0f} s after step {step} "
            f"(limit {self.timeout:g} s): a stuck collective, a deadlock or a stopped peer; "
            f"exiting with status {EXIT_CODE} so torchrun restarts the group"
        )
        return True


def _exit_process(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(EXIT_CODE)


class NoWatchdog:
    """What `watchdog(0)` returns: the same interface, never trips."""

    tripped = False

    def beat(self, step: int) -> None:
        pass

    @contextmanager
    def paused(self) -> Iterator[None]:
        yield

    def close(self) -> None:
        pass


def watchdog(timeout: float) -> Watchdog | NoWatchdog:
    """A started watchdog, or none when `timeout` is 0 (hang detection off)."""
    return Watchdog(timeout) if timeout > 0 else NoWatchdog()
