"""The agents' exit barrier counts the nodes still alive, not the round's nodes.

When its workers finish, torch's agent waits in an exit barrier until every
agent of the round got there, up to 300 s (`SimpleElasticAgent._exit_barrier`:
the agent serving the c10d store must outlive the others' last use of it). With
TORCHREVIVE_SURVIVORS=train-on a job can end without a node it lost on the way
(its survivors trained on without it), and torch's barrier would then wait its
whole 300 s for that node. This barrier (the agent's under train-on,
elastic._agent.launcher.revive_agent) waits for the round's *live* nodes:
those torch's rendezvous still counts as participants, which drops a node its
keep-alive no longer reaches (about 3 s under torchrevive-run).

Invariants:
- Every agent counts itself once and waits until the count reaches the live
  participants, re-read on every poll (a node lost a moment before the end is
  dropped a few seconds later), at most torch's exit barrier timeout.
- An agent that got through may leave at once: an agent that then finds the
  store gone got through as well (the count had reached everyone alive), so a
  store error ends its wait too. Nothing here raises: the workers' result
  stands, as with torch's own barrier.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from elastic._agent.timings import EXIT_BARRIER_POLL_S as _POLL_S

logger = logging.getLogger(__name__)

_KEY = "torchrevive/exit-barrier"


def live_nodes(handler: Any) -> int | None:
    """The round's participants that torch's rendezvous still counts alive; None when the handler
    is not torch's dynamic one."""
    holder = getattr(handler, "_state_holder", None)
    if holder is None:
        return None
    lock = getattr(handler, "_heartbeat_lock", None) or contextlib.nullcontext()
    with lock:  # the handler's keep-alive thread syncs the same holder under it
        holder._last_sync_time = -1  # a fresh read (torch caches the state for a second)
        holder.sync()  # drops the nodes whose keep-alive expired (torch's _sanitize)
        return len(holder.state.participants)


def wait_for_live_nodes(
    store: Any, handler: Any, *, timeout: float, clock: Any = time.monotonic, sleep: Any = time.sleep
) -> bool:
    """Count this agent at the exit and wait for the live nodes (see the module docstring); True when
    they all came, False after `timeout` or when the store or the rendezvous failed."""
    deadline = clock() + timeout
    try:
        arrived = store.add(_KEY, 1)
        while True:
            live = live_nodes(handler)
            if live is None or arrived >= live:
                return True
            if clock() >= deadline:
                logger.warning("exit barrier: %d of %d live nodes after %.0f s; leaving", arrived, live, timeout)
                return False
            sleep(_POLL_S)
            arrived = store.add(_KEY, 0)
    except Exception as error:  # noqa: BLE001 - the store's agent left: every live node had come
        logger.info("exit barrier: %s: %s; leaving", type(error).__name__, error)
        return False
