"""Stopped workers: end at once a worker that was told to stop but cannot act on it.

When torchrun's agent stops a worker group (a peer failed, a node joined), it
sends SIGTERM and waits 30 s before SIGKILL. A worker that is stopped (SIGSTOP,
a job-control stop) cannot act on the SIGTERM, so every such restart costs the
whole 30 s. The reaper is a library thread (`elastic.threads`) in the agent that looks at the
agent's workers a few times a second and SIGKILLs any that is stopped with
SIGTERM pending: what torch would do 30 s later anyway.

Invariants: it signals only this agent's workers (descendants that carry a
torchrun RANK, see `elastic.launcher.proctree.worker_rank`), and only when it sees the
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
from pathlib import Path

from elastic import threads
from elastic.launcher.proctree import descendants, status, worker_rank

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


class Reaper:
    """Call `scan()` periodically: a worker stuck on two scans in a row is SIGKILLed."""

    def __init__(self, root: int) -> None:
        self.root = root
        self._seen: set[int] = set()

    def scan(self) -> list[int]:
        """One look; returns the pids it killed."""
        stuck = stuck_workers(self.root)
        killed = []
        for pid in sorted(stuck & self._seen):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed.append(pid)
            logger.warning(
                "worker pid %d is stopped and cannot act on the SIGTERM that stops its group: "
                "sent SIGKILL instead of waiting torch's 30 s", pid,
            )
        self._seen = stuck - set(killed)
        return killed


def start_reaper(interval: float = 0.25) -> threading.Thread | None:
    """Watch this process's workers from a library thread (None off Linux); the exit stops it
    between scans (`elastic.threads`)."""
    if not Path(f"/proc/{os.getpid()}/task").is_dir():
        return None
    reaper = Reaper(os.getpid())
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            reaper.scan()
            stop.wait(interval)

    return threads.start(watch, name="elastic-stopped-worker-reaper", stop=stop.set)
