"""A launch's latest rendezvous state, copied to a key only that launch's agents can name.

The state's own key (`StateSeal.store_key`) is the same for every launch of a run, so a stranger who
recorded an earlier launch can write there, and can also simply overwrite it; `StateGuard.admit` refuses
what it finds. But the state it overwrote then lives only in the memory of the agent that wrote it. An
agent that refused the stranger's value and went on from its own older copy wrote that older state back,
and the other agent's last write was lost: in a 2:2 job one agent saw its rendezvous exit undone and
finished the old round as rank 1 of 1, while the other waited on the wait list for a round nobody would
complete (reproduced in tests/unit/test_rendezvous_overwrites.py).

So every state write a signed agent wins is also copied here, as the bytes it sealed, under
`StateSeal.shadow_key(launch)`: a name the secret and the launch id make, which a recording of another
launch cannot give (a TCPStore lists no keys; etcd keys are under the job's prefix, and a stranger who
reads them learns nothing it could not read in the state). An agent that refuses the state key's value
reads the shadow of its launch and goes on from it when it is newer than its own memory
(`StateGuard.admit`), so its next write builds on the latest state.

Invariants:
- The copy is the sealed state itself: the guard opens it as it opens the state key's value (tag,
  launch, write number, restricted unpickler); this module never interprets it.
- One `set` per won write (the state's size, like the write itself) and one read per refused read; a
  failure of either is logged and costs only the fallback (the agent's own copy), never the round.
- Writers race: the copy may be a write older than the newest. A reader takes it only when its write
  number is above what it already has, so an older copy never takes the run back.
"""

from __future__ import annotations

import logging

from torch.distributed import Store

from elastic._shared.storage.sealed_store import probe

logger = logging.getLogger(__name__)


class StateShadow:
    """The shadow copies in `store` (the rendezvous' own c10d store, or the etcd-backed one)."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def write(self, key: str, blob: bytes) -> None:
        try:
            self._store.set(key, blob)
        except (RuntimeError, ValueError, OSError, TimeoutError) as exc:
            logger.warning("could not copy the rendezvous state to its launch's shadow key: %s",
                           str(exc).splitlines()[0] if str(exc) else type(exc).__name__)

    def read(self, key: str) -> bytes | None:
        try:
            return probe(self._store, key)
        except (RuntimeError, ValueError, OSError, TimeoutError) as exc:
            logger.warning("could not read the rendezvous state's shadow copy: %s",
                           str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return None
