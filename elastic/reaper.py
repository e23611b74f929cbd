"""Frozen workers: end at once a worker that was told to stop but cannot.

When torchrun's agent stops a worker group (a peer failed, a node joined), it
sends SIGTERM and waits 30 s before SIGKILL. A worker that is stopped (SIGSTOP,
a job-control stop, a frozen cgroup) cannot act on the SIGTERM, so every such
restart costs the whole 30 s. The reaper is a daemon thread in the agent that
looks at the agent's own descendants a few times a second and SIGKILLs any
that is stopped with SIGTERM pending: what torch would do 30 s later anyway.

Invariants: it signals only descendants of this process that are in the
stopped state (`T`) with SIGTERM pending, never a running one, and never one
being traced by a debugger (`t`); it reads /proc only (Linux; elsewhere it
does nothing).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

from elastic.proctree import descendants, status

logger = logging.getLogger(__name__)

_SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def stopped_with_sigterm_pending(pid: int) -> bool:
    """State T (stopped, not traced) and SIGTERM pending for the process or a thread."""
    fields = status(pid)
    if not fields.get("State", "").startswith("T"):
        return False
    pending = int(fields.get("ShdPnd") or "0", 16) | int(fields.get("SigPnd") or "0", 16)
    return bool(pending & _SIGTERM_BIT)


def reap_once(root: int) -> list[int]:
    """SIGKILL every descendant of `root` that is stopped with SIGTERM pending; their pids."""
    reaped = []
    for pid in descendants(root):
        if stopped_with_sigterm_pending(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            reaped.append(pid)
    return reaped


def start_reaper(interval: float = 0.25) -> threading.Thread | None:
    """Watch this process's descendants from a daemon thread (None off Linux)."""
    if not Path(f"/proc/{os.getpid()}/task").is_dir():
        return None
    root = os.getpid()

    def watch() -> None:
        while True:
            for pid in reap_once(root):
                logger.warning(
                    "worker pid %d is stopped (SIGSTOP or frozen) and cannot act on the SIGTERM that stops its group: "
                    "sent SIGKILL instead of waiting torch's 30 s", pid,
                )
            time.sleep(interval)

    thread = threading.Thread(target=watch, name="elastic-frozen-worker-reaper", daemon=True)
    thread.start()
    return thread
