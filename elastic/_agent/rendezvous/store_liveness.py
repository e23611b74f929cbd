"""c10d's heartbeats in torchrevive-run: a key per node in the rendezvous store, not the whole state rewritten.

Each node's heartbeat (liveness.py) is one value, `torchrevive.rdzv.<run id>.alive/<node>`: the time
of its last beat (seconds since the epoch, by its own clock, as torch's own heartbeats are), sealed with
the job's secret (elastic._shared.storage.store_records: a stranger can neither keep a dead node alive
nor kill a live one) and written by torch's heartbeat timer every `keep_alive_interval`, and whenever
this node reads the state while its beat is half an interval old (a join may take longer than the
timer's first tick: the timer starts once a round completed). Reading the beats is a few `multi_get`s
of checked batches (store_batches) per read of the state.

Invariants: a node beats before it joins (`key_heartbeats` beats once); a beat read back is used only
when it is the job's (sealed, or, without a secret, a plain number), finite and not in the future by
more than `SKEW` (a beat from a later time is doubted: no beat); anything else is no beat (the state's
record stands).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import torch.distributed as dist

from elastic._agent.rendezvous import liveness
from elastic._shared.storage.peer_auth import PeerKey
from elastic._shared.storage.store_batches import read_present
from elastic._shared.storage.store_records import Records

SKEW = 60.0
"""Seconds a node's clock may run ahead of this one's before its beat is doubted."""


def key_heartbeats(handler: Any, store: Any, run_id: str, key: PeerKey | None) -> None:
    """Make `handler`'s heartbeats its node's key in `store` (see the module docstring); beats once now."""
    scope = f"torchrevive.rdzv.{run_id}.alive"
    records = Records(dist.PrefixStore(scope, store), key=key, scope=scope)
    me = liveness.node_key(handler._this_node)
    half = handler._settings.keep_alive_interval.total_seconds() / 2
    last = [0.0]

    def beat() -> None:
        last[0] = time.monotonic()
        records.set(me, f"{time.time():.3f}")

    def beats(nodes: Sequence[Any]) -> dict[Any, datetime | None]:
        if time.monotonic() - last[0] >= half:  # this node reads the state: it is alive, and may be joining
            beat()
        names = {liveness.node_key(node): node for node in nodes}
        raw = read_present(records.store, list(names))
        return {node: _when(records, name, raw.get(name)) for name, node in names.items()}

    liveness.install(handler, beat, beats)
    beat()


def _when(records: Records, name: str, raw: bytes | None) -> datetime | None:
    text = records.open(name, raw) if raw is not None else None
    try:
        seconds = float(text) if text is not None and len(text) <= 32 else math.nan
    except ValueError:
        return None
    if not math.isfinite(seconds) or seconds <= 0:
        return None
    now = time.time()
    return datetime.fromtimestamp(min(seconds, now), timezone.utc) if seconds <= now + SKEW else None
