"""Who holds the snapshot keeper's connection slots: the job's signed traffic first, strangers last.

A connection is *unproven* from its accept until a request on it passes the
signature check (storage.peer_auth), then *proven* for the rest of its life.
A stranger can open connections but never prove one; idle connections must not
keep the job from its own keeper.

Invariants (`Slots`, one lock, no sockets: the endpoint shuts down what it is told to evict):
- At most `total` connections hold a slot, proven or not.
- At most `per_address` unproven connections of one source address hold a slot:
  a newer one from that address replaces its oldest unproven one.
- When every slot is taken, a new connection replaces the oldest unproven
  connection of the address holding the most unproven ones; only when every
  slot is proven (the job's own traffic) is it refused (the endpoint's 503).
- A proven connection is never evicted here: it leaves when its peer closes it
  or misses a deadline (keeper_endpoint.HEADER_SECONDS between requests).

So a stranger from one address holds at most `per_address` slots and replaces
only its own; from many addresses it is replaced first; a job's new connection
is always admitted while any slot is unproven, and its request proves it
within a round trip.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Hashable
from dataclasses import dataclass, field

MAX_CONNECTIONS = 32
"""Connections a keeper serves at once."""
MAX_UNPROVEN_PER_ADDRESS = 8
"""Unproven connections one source address may hold (a node's ranks connect at once: up to 8 GPUs)."""


@dataclass
class _Held:
    address: str
    order: int  # when it was admitted, for "oldest"
    proven: bool = False


@dataclass
class Admission:
    """What `Slots.admit` decided: whether the connection holds a slot, and whom it replaced."""

    admitted: bool
    evict: list[Hashable] = field(default_factory=list)


class Slots:
    """The slot table (see the module docstring). Thread-safe."""

    def __init__(self, total: int = MAX_CONNECTIONS, per_address: int = MAX_UNPROVEN_PER_ADDRESS) -> None:
        self.total = total
        self.per_address = per_address
        self._held: dict[Hashable, _Held] = {}
        self._order = itertools.count()
        self._lock = threading.Lock()

    def admit(self, connection: Hashable, address: str) -> Admission:
        """Give `connection` (from source `address`) a slot, evicting unproven ones as needed."""
        with self._lock:
            evict = []
            mine = self._unproven(address)
            if len(mine) >= self.per_address:
                evict.append(mine[0])
            elif len(self._held) >= self.total:
                victim = self._victim()
                if victim is None:
                    return Admission(False)
                evict.append(victim)
            for gone in evict:
                del self._held[gone]
            self._held[connection] = _Held(address, next(self._order))
            return Admission(True, evict)

    def prove(self, connection: Hashable) -> None:
        """`connection` carried a request signed by the job: it keeps its slot until it ends."""
        with self._lock:
            held = self._held.get(connection)
            if held is not None:
                held.proven = True

    def release(self, connection: Hashable) -> None:
        """`connection` ended (or was evicted: then this does nothing)."""
        with self._lock:
            self._held.pop(connection, None)

    def holds(self, connection: Hashable) -> bool:
        with self._lock:
            return connection in self._held

    def counts(self) -> tuple[int, int]:
        """(proven, unproven) connections holding a slot."""
        with self._lock:
            proven = sum(h.proven for h in self._held.values())
            return proven, len(self._held) - proven

    def _unproven(self, address: str) -> list[Hashable]:
        """`address`'s unproven connections, oldest first."""
        return sorted((c for c, h in self._held.items() if not h.proven and h.address == address),
                      key=lambda c: self._held[c].order)

    def _victim(self) -> Hashable | None:
        """The oldest unproven connection of the address holding the most; None when all are proven."""
        by_address: dict[str, list[Hashable]] = {}
        for connection, held in self._held.items():
            if not held.proven:
                by_address.setdefault(held.address, []).append(connection)
        if not by_address:
            return None
        most = max(len(c) for c in by_address.values())
        candidates = [c for group in by_address.values() if len(group) == most for c in group]
        return min(candidates, key=lambda c: self._held[c].order)
