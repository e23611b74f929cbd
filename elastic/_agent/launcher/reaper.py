"""Stopped workers: end at once a worker that was told to stop but cannot act on it.

When torchrun's agent stops a worker group (a peer failed, a node joined), it
sends SIGTERM and waits 30 s before SIGKILL. A worker that is stopped (SIGSTOP,
a job-control stop) cannot act on the SIGTERM, so every such restart costs the
whole 30 s. The reaper is a library thread (`elastic._shared.common.threads`) in the agent that looks at the
agent's workers a few times a second and SIGKILLs any that is stopped with
SIGTERM pending: what torch would do 30 s later anyway.

With heals in place (TORCHREVIVE_SURVIVORS=keep) it also ends a worker that
has stayed stopped `frozen_after` seconds, SIGTERM or not: its peers wait on it
inside a collective, and a stopped process never fails it (its sockets stay
open). SIGKILLed, it is a failed worker like any other, which its agent
replaces in place while the other workers keep their processes. A scan that
comes late (this agent was stopped too: a suspended job, where every process
stops and resumes together) forgets what it saw stopped before.

Invariants: it signals only this agent's workers (descendants that carry a
torchrun RANK, see `elastic._agent.launcher.proctree.worker_rank`), and only when it sees the
same worker stopped (`T`, not traced `t`) with SIGTERM pending on two scans in
a row, so that a SIGTERM followed at once by SIGCONT (a shell's `kill` of a
stopped job, a scheduler resuming one) still reaches the worker's handler. It
reads /proc only (Linux; elsewhere it does nothing).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from elastic._agent.launcher.proctree import descendants, status, worker_rank
from elastic._shared.common import threads

logger = logging.getLogger(__name__)

_SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def stopped_with_sigterm_pending(pid: int) -> bool:
    """State T (stopped, not traced) and SIGTERM pending for the process or a thread."""
    fields = status(pid)
    if not fields.get("State", "").startswith("T"):
        return False
    pending = int(fields.get("ShdPnd") or "0", 16) | int(fields.get("SigPnd") or "0", 16)
    return bool(pending & _SIGTERM_BIT)


def stuck_workers(root: int) -> set[int]:
    """This agent's workers that are stopped with SIGTERM pending, right now."""
    return {pid for pid in descendants(root) if worker_rank(pid) is not None and stopped_with_sigterm_pending(pid)}


def stopped_workers(root: int) -> dict[int, int]:
    """This agent's workers that are stopped (state T) right now: pid -> rank."""
    found = {}
    for pid in descendants(root):
        rank = worker_rank(pid)
        if rank is not None and status(pid).get("State", "").startswith("T"):
            found[pid] = rank
    return found


class Reaper:
    """Call `scan()` every `interval` seconds: a worker stuck on two scans in a row is SIGKILLed,
    and with `frozen_after` one stopped that long (see the module docstring)."""

    def __init__(
        self, root: int, *, frozen_after: float | None = None, interval: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = root
        self._seen: set[int] = set()
        self.frozen_after = frozen_after
        self._late_after = max(4 * interval, 1.0)
        self._clock = clock
        self._last_scan: float | None = None
        self._stopped_since: dict[int, float] = {}

    def scan(self) -> list[int]:
        """One look; returns the pids it killed."""
        frozen = self._end_frozen() if self.frozen_after is not None else []
        stuck = stuck_workers(self.root) - set(frozen)
        killed = [pid for pid in sorted(stuck & self._seen) if _kill(
            pid, "worker pid %d is stopped and cannot act on the SIGTERM that stops its group: "
                 "sent SIGKILL instead of waiting torch's 30 s", pid)]
        self._seen = stuck - set(killed)
        return frozen + killed

    def _end_frozen(self) -> list[int]:
        now = self._clock()
        if self._last_scan is not None and now - self._last_scan > self._late_after:
            self._stopped_since.clear()  # this agent was stopped too: nothing to blame on its workers
        self._last_scan = now
        stopped = stopped_workers(self.root)
        self._stopped_since = {pid: self._stopped_since.get(pid, now) for pid in stopped}
        killed = [pid for pid, since in sorted(self._stopped_since.items()) if now - since >= self.frozen_after and _kill(
            pid, "worker rank %d (pid %d) has been stopped for %.1f s while its peers wait on it: sent SIGKILL, "
                 "so that it is replaced in place", stopped[pid], pid, now - since)]
        for pid in killed:
            del self._stopped_since[pid]
        return killed


def _kill(pid: int, why: str, *args: object) -> bool:
    """SIGKILL `pid` and log `why`; False when it was gone already."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    logger.warning(why, *args)
    return True


def start_reaper(interval: float = 0.25, *, frozen_after: float | None = None) -> threading.Thread | None:
    """Watch this process's workers from a library thread (None off Linux); the exit stops it
    between scans (`elastic._shared.common.threads`)."""
    if not Path(f"/proc/{os.getpid()}/task").is_dir():
        return None
    reaper = Reaper(os.getpid(), frozen_after=frozen_after, interval=interval)
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            reaper.scan()
            stop.wait(interval)

    return threads.start(watch, name="elastic-stopped-worker-reaper", stop=stop.set)
