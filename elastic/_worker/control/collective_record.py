"""Each rank's record of its recent collectives: what a stalled job compares to name its culprit.

    record = CollectiveRecord()
    seq = record.enter("step vote", step=20)   # as a rank enters a collective
    record.leave(seq)                          # and once it has left it

The runtime records what every rank of a job does in the same order: a training step (its gradient
all-reduce, DDP's buckets; entered when the step before completed, `Watchdog.beat`, left when the step
completes) and the step vote's wait (elastic._worker.control.step_vote). So the same collective has the
same sequence number on every rank, and a rank whose newest number is lower never entered the one the
others wait in (elastic._worker.control.culprits).

torch's Flight Recorder records gloo's collectives too (torch 2.14: `_dump_fr_trace`), but for gloo
it leaves every entry "scheduled", with no time it started or completed, and it knows nothing of steps:
it cannot tell a rank that never entered a collective from one inside it. This record can.

A process is one rank: the record of this process is registered once (`register`, by the watchdog
that the run starts) and the step vote finds it there (`of_this_process`).

Invariants: sequence numbers start at 1 and grow by one per `enter`; at most `KEEP` entries are kept
(the oldest go first); `enter`, `leave` and `snapshot` may be called from any thread (the stall
detector reads while the main thread writes) and never block for longer than a lock held for a few
assignments.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

KEEP = 64
"""Entries kept: enough for the steps and votes of a stall's last seconds."""


@dataclass(frozen=True)
class Entry:
    seq: int
    op: str
    step: int
    entered: float
    """Monotonic seconds when the rank entered it."""
    left: float | None = None
    """Monotonic seconds when it left (None: still inside)."""

    def describe(self) -> str:
        return f"{self.op} at step {self.step}"


class CollectiveRecord:
    """The newest `KEEP` collectives of this rank (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: deque[Entry] = deque(maxlen=KEEP)
        self._seq = 0

    def enter(self, op: str, step: int) -> int:
        """This rank enters collective `op` of `step`; its sequence number."""
        with self._lock:
            self._seq += 1
            self._entries.append(Entry(self._seq, op, step, self._clock()))
            return self._seq

    def leave(self, seq: int) -> None:
        """This rank has left collective `seq` (a number `enter` gave; an unknown one is ignored)."""
        with self._lock:
            for index in range(len(self._entries) - 1, -1, -1):
                entry = self._entries[index]
                if entry.seq == seq:
                    if entry.left is None:
                        self._entries[index] = Entry(entry.seq, entry.op, entry.step, entry.entered, self._clock())
                    return
                if entry.seq < seq:
                    return

    def newest(self) -> Entry | None:
        with self._lock:
            return self._entries[-1] if self._entries else None

    def last_done(self) -> Entry | None:
        """The newest entry this rank has left."""
        with self._lock:
            return next((entry for entry in reversed(self._entries) if entry.left is not None), None)

    def snapshot(self) -> list[Entry]:
        """The entries kept, oldest first."""
        with self._lock:
            return list(self._entries)


_this_process: CollectiveRecord | None = None


def register(record: CollectiveRecord) -> None:
    """Make `record` this process's (the run's watchdog does, as it starts)."""
    global _this_process
    _this_process = record


def of_this_process() -> CollectiveRecord | None:
    """This process's record (None: no run registered one: hang detection is off)."""
    return _this_process
