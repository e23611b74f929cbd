"""Who is alive in a rendezvous: each node's heartbeat in a key of its own, not in the one shared state.

torch's dynamic rendezvous keeps every node's last heartbeat in its shared state, so each node rewrites
the whole state (O(N) bytes, a compare-and-set all N nodes contend for) every `keep_alive_interval`.
With torchrevive-run's 1 s interval and 3 missed beats to death, the first round of 64 simulated nodes
on one etcd, and of 256 on one TCPStore, never closed (benchmarks/scale.py): the nodes could not win
enough compare-and-sets a second to keep their own heartbeats fresh, so torch kept declaring joined
nodes dead and they joined again.

A `SealedHandler` (handlers.py) given `Heartbeats` (c10d-sealed: store_liveness, etcd-v3: etcd_liveness)
keeps its node's heartbeats out of the state:

- torch's heartbeat timer (`_keep_alive`, started with every round) calls `beat` instead: one small
  sealed write of this node's own key (etcd: its key is rewritten on its lease's own thread), O(1) bytes;
- whenever the state is read (torch's `sync`), before torch judges who is dead (`_sanitize`,
  `HeartbeatStateHolder`), `read` says, for the state's nodes, when each last beat (`None`: it does not
  know, e.g. a value not sealed for this launch: the state's record stands); this agent's copy takes it,
  and torch's own rule (no beat for `keep_alive_interval` x `keep_alive_max_attempt`) declares the dead
  ones. The keys are read at most every half `keep_alive_interval` (a round's writes, which lose to each
  other's, do not each read them again): O(N) where reading the state is O(N) already;
- the state guard asks `heard_from` whether a launch it meets is live (state_guard): the state's own
  record of a beat is written only with membership changes now, so it ages while a job trains.

A beat is a time (seconds since the epoch, by the node's clock, as torch's own heartbeats are), sealed
in the launch's scope like every value of the agents' store: a stranger can neither forge one nor move
one to another node, run or launch, and one written back later says only that the node was alive then.
A node's own heartbeat in the state is written with each membership change it makes (torch's join
writes it), so a node whose key is not (yet) readable is judged as torch does.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from elastic._agent.rendezvous.named_events import NamedStateHolder
from elastic._agent.timings import SKEW

Beats = Callable[[Sequence[Any], str | None], dict[Any, datetime | None]]
"""The state's nodes' last beats as their keys sealed in a launch's scope say (launch None: this agent's
own); None for a node: unknown."""

MAX_STAMP = 32
"""The longest text a beat may be."""


def node_key(node: Any) -> str:
    """The name of torch's node (`_NodeDesc`: address, pid, local id) in the keys of the heartbeats."""
    return f"{node.addr}:{node.pid}:{node.local_id}"


def dead_after_seconds(settings: Any) -> int:
    """Seconds torch waits before it declares a node dead (`settings`: torch's rendezvous settings): its
    interval times its attempts, at least 2."""
    return max(2, round(settings.keep_alive_interval.total_seconds() * settings.keep_alive_max_attempt))


def now() -> datetime:
    return datetime.now(timezone.utc)


def stamp() -> str:
    """A beat: this moment, as a node writes it into its key."""
    return f"{time.time():.3f}"


def beat_time(text: bytes | None) -> datetime | None:
    """The beat a verified value holds; None when there is none, or it is not a time, or it lies more
    than `SKEW` in the future (a beat slightly ahead is taken as now)."""
    try:
        seconds = float(text) if text is not None and len(text) <= MAX_STAMP and text.isascii() else math.nan
    except ValueError:
        return None
    if not math.isfinite(seconds) or seconds <= 0:
        return None
    current = time.time()
    return datetime.fromtimestamp(min(seconds, current), timezone.utc) if seconds <= current + SKEW else None


@dataclass
class Heartbeats:
    """One handler's heartbeats in keys of their own (see the module docstring). Thread-safe: torch's
    timer beats while the agent's thread syncs."""

    beat: Callable[[], None]
    """Write this node's beat (called by torch's heartbeat timer, under the handler's heartbeat lock)."""
    read: Beats
    fresh_for: float
    """Seconds one read of the keys serves (half the keep-alive interval)."""
    read_at: float = -math.inf
    """When the keys were read last (monotonic; tests age it)."""
    last: dict[Any, datetime | None] = field(default_factory=dict)
    reads: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def apply(self, state: Any) -> None:
        """Before torch judges who is dead: each node's record in this agent's copy of `state` from its key."""
        if not state.last_heartbeats:
            return
        with self._lock:
            if time.monotonic() - self.read_at >= self.fresh_for:  # (a node that just joined is judged on its record)
                self.last, self.read_at = self.read(list(state.last_heartbeats), None), time.monotonic()
                self.reads += 1
            beats = self.last
        for node, when in beats.items():
            if when is not None and node in state.last_heartbeats:
                state.last_heartbeats[node] = when  # the node's own key knows better than any copy

    def heard_from(self, launch: str, nodes: Sequence[Any]) -> list[datetime]:
        """The beats `nodes` sealed in `launch`'s scope (for the state guard: is that launch live?)."""
        return [when for when in self.read(nodes, launch).values() if when is not None]


class HeartbeatStateHolder(NamedStateHolder):
    """torch's state holder (its events named); with `heartbeats`, its copies learn the beats from the keys."""

    heartbeats: Heartbeats | None = None

    def _sanitize(self) -> None:
        if self.heartbeats is not None:
            self.heartbeats.apply(self._state)
        super()._sanitize()


def lease_beats(beats: dict[str, datetime | None], nodes: Sequence[Any], dead_after: timedelta) -> dict[Any, datetime | None]:
    """Beats from keys on leases (`beats`: each key there, by node name, and the beat it holds, None when
    it does not verify): a node whose key is gone (its lease ran out, a `dead_after` after its last
    keep-alive) beat longer ago than that: it is dead."""
    gone = now() - dead_after - _JUST
    return {node: beats.get(node_key(node)) if node_key(node) in beats else gone for node in nodes}


_JUST = timedelta(milliseconds=1)
