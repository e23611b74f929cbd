"""Ending this node's workers a hang named (`end_now`), but not one that started after the stall was named.

A verdict names ranks; the agent on a culprit's node ends that rank's worker (job_watch). Under
--survivors keep or train-on a stopped culprit may be ended and replaced in place (the reaper, or its own
fault) while the comparison that names it runs; its verdict, posted after, then names the rank the
replacement holds. Ending it too made a third strike in a few seconds, and a healthy node was set aside
(tests/chaos/test_scenarios.py, train-on through a kill, a hang and a lost node). The verdict says when
its comparison began (`since`: elastic._worker.control.culprits.Verdict); a worker that started after
it is a replacement, not what the job waited for.
"""

from __future__ import annotations

import math
import os
import signal
import sys
from collections.abc import Mapping
from typing import Any

from elastic._shared.storage.claim import started_at


def since_of(note: Mapping[str, Any]) -> float | None:
    """A hang note's `since`, checked: a finite positive number of seconds since the epoch; None otherwise."""
    since = note.get("since")
    if type(since) in (int, float) and math.isfinite(since) and since > 0:
        return float(since)
    return None


def replaced_since(worker_group: Any, rank: Any, since: float) -> bool:
    """Whether this node's worker of global rank `rank` started after `since` (one line says so)."""
    for worker in getattr(worker_group, "workers", None) or ():
        if worker.global_rank == rank and type(worker.id) is int and worker.id > 0:
            started = started_at(worker.id)
            if started is not None and started > since:
                print(f"torchrevive-run: not ending worker rank {rank} (pid {worker.id}): it started after the "
                      "hang was named, as a replacement", file=sys.stderr, flush=True)
                return True
    return False


def end_now(worker_group: Any, ranks: Any = None) -> list[tuple[int, int]]:
    """SIGKILL this node's workers of `worker_group` (those of global `ranks` only, when given); (rank, pid)
    of each one signalled (one already gone is signalled in vain)."""
    ended = []
    for worker in getattr(worker_group, "workers", None) or ():
        pid = worker.id
        if (ranks is None or worker.global_rank in ranks) and type(pid) is int and pid > 0:
            ended.append((worker.global_rank, pid))
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:  # gone already
                pass
    return ended
