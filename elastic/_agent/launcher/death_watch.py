"""An agent that notices a worker's death the moment it happens, not at its next look.

torch's agent looks at its workers every `--monitor-interval` seconds (0.1 by
default): it sleeps, then polls. A worker killed just after a look is noticed
up to a whole interval later, and every kind of recovery (a new round, a heal
in place, a shrink) starts only then: on average half an interval, at worst a
whole one, added to every failure.

`DeathWatch` (held by the agent, elastic._agent.launcher.revive_agent) keeps
the looks at the same pace but spends the time between them waiting on the
workers' process descriptors (Linux `pidfd`, which works for processes that
are not this agent's children: warm workers are the fork server's) instead of
sleeping: a death ends the wait at once and the look that follows finds it
(looking again for up to `REAP_SECONDS` until torch has heard of it). torch's own sleep is cut to `TORCH_SLEEP`, and the
interval the user gave bounds each wait.

Invariants:
- A look is never later than without this (the wait ends at the interval).
- A worker already seen gone (exited and not yet reaped or replaced, e.g.
  one that finished before its peers) is not waited on again, so the agent
  never spins on it; a worker group started again gets new descriptors.
- Where descriptors cannot be opened (an old kernel, another pid namespace),
  the wait is a plain sleep of the interval: torch's behaviour.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable
from typing import Any

from elastic._agent.timings import REAP_POLL, REAP_SECONDS, TORCH_SLEEP


class ExitWaiter:
    """Waits until one of a set of processes exits, or a timeout (see the module docstring)."""

    def __init__(self) -> None:
        self._open: dict[int, int] = {}  # pid -> its descriptor, for pids still running when last seen
        self._gone: set[int] = set()

    def wait(self, pids: set[int], timeout: float) -> bool:
        """Return once a process of `pids` not seen gone before exits (True), or after `timeout` seconds."""
        self._forget(pids)
        for pid in pids - self._open.keys() - self._gone:
            try:
                self._open[pid] = os.pidfd_open(pid)
            except ProcessLookupError:
                self._gone.add(pid)
                return True  # gone before we looked: the look that follows finds it
            except (OSError, AttributeError):
                time.sleep(timeout)  # no descriptors here: torch's plain sleep
                return False
        if not self._open:
            time.sleep(timeout)
            return False
        ready, _, _ = select.select(list(self._open.values()), [], [], timeout)
        for descriptor in ready:
            pid = next(p for p, fd in self._open.items() if fd == descriptor)
            os.close(self._open.pop(pid))
            self._gone.add(pid)
        return bool(ready)

    def _forget(self, pids: set[int]) -> None:
        """Let go of processes no longer in the group (replaced, or a new group started)."""
        for pid in list(self._open):
            if pid not in pids:
                os.close(self._open.pop(pid))
        self._gone &= pids

    def close(self) -> None:
        self._forget(set())


def look_until_heard(look: Callable[[], Any], *, died: bool) -> Any:
    """`look()`'s result; after a wait that a death ended (`died`), looked at again while it finds the
    workers healthy, for up to `REAP_SECONDS` (see there)."""
    from torch.distributed.elastic.agent.server.api import WorkerState

    result = look()
    deadline = time.monotonic() + REAP_SECONDS
    while died and getattr(result, "state", None) == WorkerState.HEALTHY and time.monotonic() < deadline:
        time.sleep(REAP_POLL)
        result = look()
    return result


class DeathWatch:
    """One agent's wait before each look at its workers (see the module docstring): at most the user's
    `interval` less the `TORCH_SLEEP` torch's loop still sleeps, so a look is never later than without it."""

    def __init__(self, interval: float) -> None:
        self._waiter = ExitWaiter()
        self._wait_for = max(0.0, interval - TORCH_SLEEP)

    def look(self, pids: set[Any], look: Callable[[], Any]) -> Any:
        """Wait on the workers `pids` (a worker not started yet has none: skipped), then `look()`'s result
        (`look_until_heard`)."""
        died = self._waiter.wait({pid for pid in pids if isinstance(pid, int) and pid > 0}, self._wait_for)
        return look_until_heard(look, died=died)
