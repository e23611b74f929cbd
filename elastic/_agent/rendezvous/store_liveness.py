"""c10d-sealed's heartbeats: a key per node in the rendezvous store, not the whole state rewritten.

Each node's heartbeat (liveness.py) is one value of the agents' `SealedStore` (handlers.build), under
`torchrevive.rdzv.<run id>.alive/<node>`: the time of its last beat, sealed with the job's secret in the
launch's scope (a stranger can neither keep a dead node alive nor kill a live one; a beat of an earlier
launch does not verify in this one). It is written by torch's heartbeat timer every
`keep_alive_interval`, and whenever this node reads the state while its beat is half an interval old (a
join may take longer than the timer's first tick: the timer starts once a round completed), or took
a launch since it beat (its beat is then sealed in the launch the others read it in before they read it). Reading the
beats is a few `check`s and `multi_get`s of batches of the inner store (store_batches), each value then
opened by the sealed store: never one blocking read per key, never a wait on a key that is not there.

Invariants: a node beats before it joins (`key_heartbeats` beats once); a beat read back is used only
when it verifies in the scope asked for and is a time (liveness.beat_time); anything else is no beat
(the state's record stands).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from elastic._agent.rendezvous import liveness
from elastic._shared.storage.sealed_store import SealedStore
from elastic._shared.storage.store_batches import read_present


def key_heartbeats(node: Any, settings: Any, store: SealedStore, scope_of: Callable[[str], str]) -> liveness.Heartbeats:
    """Heartbeats for torch's `node` (with rendezvous `settings`) as keys of `store`, the agents' sealed store
    (`scope_of(launch)`: the scope a launch's values are sealed in); beats once now."""
    prefix = f"torchrevive.rdzv.{settings.run_id}.alive/"
    me = prefix + liveness.node_key(node)
    half = settings.keep_alive_interval.total_seconds() / 2
    last: list[Any] = [-half, None]  # when this node beat last, and in which scope
    lock = threading.Lock()

    def beat() -> None:
        with lock:
            last[:] = time.monotonic(), store.current_scope()
        store.set(me, liveness.stamp())

    def read(nodes: Sequence[Any], launch: str | None) -> dict[Any, datetime | None]:
        with lock:
            due = launch is None and (time.monotonic() - last[0] >= half or last[1] != store.current_scope())
        if due:  # this node reads the state: it is alive, and may be joining (or just took the job's launch)
            beat()
        names = {prefix + liveness.node_key(n): n for n in nodes}
        raw = read_present(store.inner, list(names))
        scope = None if launch is None else scope_of(launch)
        return {n: liveness.beat_time(store.open(name, raw[name], scope=scope)) if name in raw else None
                for name, n in names.items()}

    beat()
    return liveness.Heartbeats(beat, read, fresh_for=half)
