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

Before it trips, its thread names the culprit: each step is an entry of this
rank's record of collectives (`step_began` enters it, `beat` leaves it), and
after a fifth of `timeout` without a step the ranks that can still talk
compare their records (elastic._worker.control.hang_names) and the rank(s) the
job waits for are named on every agent and in the event log. `beat` also
notes the step for the agent (elastic._shared.protocol.worker_notes), which
names the step of a worker that died without a word.

Invariants: the watchdog is disarmed until the first `beat()` (restore and the
first step may be slow: compilation, data loading), and `paused()` suspends it
around work that legitimately takes longer than a step (validation, a final
checkpoint flush); the hang naming sees the same stall clock, paused alike.
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from elastic._shared.common import threads
from elastic._shared.protocol import worker_notes
from elastic._worker.control import collective_record, hang_names
from elastic._worker.control.collective_record import CollectiveRecord
from elastic._worker.runtime.worker_env import WorkerEnv

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
        record: CollectiveRecord | None = None,
        namer: hang_names.HangNamer | None = None,
        progress: worker_notes.ProgressNote | None = None,
    ) -> None:
        """`on_trip` gets the message (default: print it, dump the stacks, exit);
        `poll` is how often the thread looks; `clock` is the time source (tests
        pass a fake one and call `check()` themselves); `record` this rank's record of
        collectives, `namer` the hang naming it feeds, `progress` the agent's note of the step."""
        if timeout <= 0:
            raise ValueError("watchdog timeout must be positive")
        self.timeout = timeout
        self._on_trip = on_trip or _exit_process
        self._poll = poll if poll is not None else min(1.0, timeout / 20)
        self._clock = clock
        self._lock = threading.Lock()
        self._last_beat: float | None = None  # None: disarmed
        self._last_step: int | None = None
        self._beats = 0
        self._pauses = 0
        self.record = record if record is not None else CollectiveRecord(clock)
        self._namer = namer
        self._progress = progress
        self._step_seq: int | None = None
        self._stop = threading.Event()
        self.tripped = False
        self._thread = threads.start(self._watch, name="elastic-watchdog", stop=self._stop.set)

    def step_began(self, step: int) -> None:
        """The loop hands step `step`'s batch to the script: it enters the step's collectives."""
        self._step_seq = self.record.enter("train step", step)
        if self._progress is not None and not self._beats:  # a start's first step: it resumed after step - 1
            self._progress.write(step - 1)

    def beat(self, step: int) -> None:
        """The loop completed `step`; cheap enough to call every step."""
        with self._lock:
            self._last_beat = self._clock()
            self._last_step = step
            self._beats += 1
        if self._step_seq is not None:
            self.record.leave(self._step_seq)
            self._step_seq = None
        if self._progress is not None:
            self._progress.write(step)

    def stalled(self) -> tuple[float | None, tuple[int, int, bool]]:
        """Seconds since this rank last made progress (a beat, or entering or leaving a collective: a
        first step after a restore counts too, before the watchdog is armed; None: paused, or nothing
        yet), and a mark of that progress that changes whenever it does."""
        newest = self.record.newest()
        with self._lock:
            beats, last_beat, paused = self._beats, self._last_beat, self._pauses
        mark = (beats, newest.seq if newest else 0, bool(newest and newest.left is not None))
        if paused:
            return None, mark
        moments = [t for t in (last_beat, newest.left if newest else None, newest.entered if newest else None)
                   if t is not None]
        if not moments:
            return None, mark
        return self._clock() - max(moments), mark

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
        if self._progress is not None:
            self._progress.close()
            self._progress = None

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _watch(self) -> None:
        while not self._stop.wait(self._poll):
            if self._namer is not None:
                self._namer.look(*self.stalled())
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

    def step_began(self, step: int) -> None:
        pass

    def beat(self, step: int) -> None:
        pass

    @contextmanager
    def paused(self) -> Iterator[None]:
        yield

    def close(self) -> None:
        pass


def watchdog(timeout: float, *, distributed: bool = False, env: WorkerEnv | None = None) -> Watchdog | NoWatchdog:
    """A started watchdog, or none when `timeout` is 0 (hang detection off); in a job of several
    ranks (`distributed`) it names a hang's culprit first (`hang_names`). `env`: the worker's
    (`ctx.env`), which says where its agent takes notes (progress, a named hang) and its node's name;
    None: a bare one (no agent: the verdict goes to stderr, the node is the host)."""
    if timeout <= 0:
        return NoWatchdog()
    env = env if env is not None else WorkerEnv.bare()
    record = CollectiveRecord()
    collective_record.register(record)  # the step vote's waits are entries of it too
    namer = None
    if distributed:
        after = hang_names.name_after(timeout)
        namer = hang_names.HangNamer(
            record, name_after=after, gather=after, store=hang_names.default_store,
            place=functools.partial(hang_names.this_rank, env),
            report=functools.partial(hang_names.report_to_agent, env=env), main_thread=threading.main_thread().ident,
            environ=env.variables,
        )
    return Watchdog(timeout, record=record, namer=namer, progress=worker_notes.for_worker(env.variables))
