"""Reading many keys of a c10d store in a few calls, never waiting on one that is not there.

A TCPStore `get` or `multi_get` of a missing key blocks until the store's timeout (and a client whose
read timed out is left in an undefined state), and one `get` per key is one round trip per key: reading
N keys costs N trips. `read_present` checks a batch's keys in one call, reads the batch in one
`multi_get` when they are all there, and splits a batch with a missing key in halves, so N keys cost
about 2 N / `BATCH` calls, a few more per missing key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

BATCH = 128
"""Keys per `check` and `multi_get`."""


def read_present(store: Any, names: Sequence[str], batch: int = BATCH) -> dict[str, bytes]:
    """The values of those of `names` that `store` holds (the others are absent from the result)."""
    found: dict[str, bytes] = {}
    pending = [list(names[i : i + batch]) for i in range(0, len(names), batch)]
    while pending:
        keys = pending.pop()
        if not store.check(keys):
            if len(keys) > 1:
                pending += [keys[: len(keys) // 2], keys[len(keys) // 2 :]]
            continue
        for name, raw in zip(keys, store.multi_get(keys)):
            found[name] = bytes(raw)
    return found
