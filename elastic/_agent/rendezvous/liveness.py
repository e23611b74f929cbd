"""Who is alive in a rendezvous: each node's heartbeat in a key of its own, not in the one shared state.

torch's dynamic rendezvous keeps every node's last heartbeat in its shared state, so each node rewrites
the whole state (O(N) bytes, a compare-and-set all N nodes contend for) every `keep_alive_interval`.
With torchrevive-run's 1 s interval and 3 missed beats to death, the first round of 64 simulated nodes
on one etcd, and of 256 on one TCPStore, never closed (benchmarks/scale.py): the nodes could not win
enough compare-and-sets a second to keep their own heartbeats fresh, so torch kept declaring joined
nodes dead and they joined again.

`install(handler, beat, alive)` moves a handler's heartbeats out of the state:

- torch's heartbeat timer (`_keep_alive`, started with every round) calls `beat` instead: one small
  write of this node's own key (etcd: nothing, its lease's keep-alive is the beat), O(1) bytes;
- whenever the state is read (torch's `sync`), before torch judges who is dead (`_sanitize`), `beats`
  says, for the state's nodes, when each last beat (`None`: it does not know, e.g. a value that is not
  the job's: the state's record stands); this agent's copy takes it, and torch's own rule (no beat for
  `keep_alive_interval` x `keep_alive_max_attempt`) declares the dead ones. The keys are read at most
  every half `keep_alive_interval` (a round's writes, which lose to each other's, do not each read them
  again): O(N) where reading the state is O(N) already, and nothing in between.

A node's own heartbeat in the state is written with each membership change it makes (torch's join
writes it), so a node without a key (a torchrevive-run of an earlier release) is judged as torch does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

Beats = Callable[[Sequence[Any]], dict[Any, datetime | None]]
"""The nodes' last beats (None: unknown), for the state's nodes."""


def node_key(node: Any) -> str:
    """The name of torch's node (`_NodeDesc`: address, pid, local id) in the keys of the heartbeats."""
    return f"{node.addr}:{node.pid}:{node.local_id}"


def dead_after_seconds(handler: Any) -> int:
    """Seconds torch waits before it declares a node dead: its interval times its attempts (at least 2)."""
    settings = handler._settings
    return max(2, round(settings.keep_alive_interval.total_seconds() * settings.keep_alive_max_attempt))


def install(handler: Any, beat: Callable[[], None], beats: Beats) -> None:
    """Make `handler`'s heartbeats `beat`, and its copies of the state learn the beats from `beats`
    (see the module docstring)."""
    holder = handler._state_holder
    sanitize = holder._sanitize
    fresh_for = handler._settings.keep_alive_interval.total_seconds() / 2
    read: dict[str, Any] = {"at": -math.inf, "beats": {}}
    holder.beats_read = read  # when the keys were read last, and what they said (tests age it)

    def sanitize_with_beats() -> None:
        state = holder._state
        if state.last_heartbeats:
            if time.monotonic() - read["at"] >= fresh_for:  # (a node that just joined is judged on its record)
                read["beats"], read["at"] = beats(list(state.last_heartbeats)), time.monotonic()
            for node, when in read["beats"].items():
                if when is not None and node in state.last_heartbeats:
                    state.last_heartbeats[node] = when  # the node's own key knows better than any copy
        sanitize()

    holder._sanitize = sanitize_with_beats  # torch's sync() calls it on its state holder

    def keep_alive() -> None:
        with handler._heartbeat_lock:  # as torch's: never in the middle of this agent's own rendezvous step
            beat()

    handler._keep_alive = keep_alive  # the timer torch starts with every round calls it


def now() -> datetime:
    return datetime.now(timezone.utc)


def lease_beats(live: set[str], nodes: Sequence[Any], dead_after: timedelta) -> dict[Any, datetime | None]:
    """Beats from leases: a node whose key exists beat now; one whose key is gone (its lease ran out, a
    `dead_after` after its last keep-alive) beat longer ago than that: it is dead."""
    at = now()
    return {node: at if node_key(node) in live else at - dead_after - _JUST for node in nodes}


_JUST = timedelta(milliseconds=1)
