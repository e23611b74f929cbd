"""Records the survivors keep in the rendezvous store: sealed with the job's secret, read back checked.

torch's rendezvous store (a TCPStore) takes anyone's writes. The heals in place
(elastic._agent.launcher.in_place, elastic._worker.survivors) keep their views,
tickets, member notes, failure marks and outcomes there, so each such value goes
in as `VALUE~TAG`: TAG is `PeerKey.record_tag` over the round's namespace (the
scope), the record's key and the value. A stranger without the secret can
neither forge a record nor move one to another key or another round. Without a
secret (TORCHREVIVE_SNAPSHOTS=0, or a keeper that could not start) values go in
bare and are only validated.

Invariants:
- `get` and `compare_set` return a value only when it is ASCII, at most
  `MAX_VALUE` characters and (with a secret) its tag verifies; anything else
  is `None`, with one warning per key, never an exception.
- Counters (`store.add`) cannot carry a tag: whoever reads one bounds it
  (`strict_count`), and nothing loops once per unit of a count it read.
- What is left: a stranger can replay a value the job itself wrote under the
  same key in the same round, and can stall the job (torch's store has no
  authentication); docs/security.md says so.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

from elastic._shared.storage.peer_auth import PeerKey

logger = logging.getLogger(__name__)

MAX_VALUE = 4096
"""The longest value a record holds (a view of 65536 members would not fit: views are bounded by the world)."""
_SEPARATOR = "~"
_TAG_DIGITS = 32
_MAX_WARNED = 256


def strict_count(text: str, *, most: int) -> int | None:
    """`text` as a count from 0 to `most`, ASCII digits only ("²" and "1_0" are not counts); else None."""
    if not (text and len(text) <= 19 and text.isascii() and text.isdigit()):
        return None
    value = int(text)
    return value if value <= most else None


class Records:
    """One round's records in `store` (the round's namespace of the rendezvous store), sealed with `key`."""

    def __init__(self, store: Any, *, key: PeerKey | None = None, scope: str = "", world: int = 1 << 16) -> None:
        self.store = store
        """The store itself (counters, and the process groups' own keys, go there directly)."""
        self.world = world
        """The most workers the round has: every rank and count read back is below or at it."""
        self._key = key
        self._scope = scope
        self._warned: set[str] = set()

    @property
    def signed(self) -> bool:
        return self._key is not None

    def on(self, store: Any) -> Records:
        """The same records read through `store` (another connection to the same namespace)."""
        return Records(store, key=self._key, scope=self._scope, world=self.world)

    def seal(self, name: str, value: str) -> str:
        """What goes into the store for `value` under `name`."""
        if self._key is None:
            return value
        return f"{value}{_SEPARATOR}{self._key.record_tag(self._scope, name, value)}"

    def open(self, name: str, raw: bytes) -> str | None:
        """The value `raw` (read under `name`) holds, or None (one warning per key) when it is not the job's."""
        text = raw.decode("ascii", errors="replace")
        if len(raw) > MAX_VALUE + 1 + _TAG_DIGITS or not text.isascii() or "\ufffd" in text:
            return self.warn_once(name, "is not a short ASCII value")
        if self._key is None:
            value, _, tag = text.rpartition(_SEPARATOR)  # a job's tag, which this node cannot check
            return value if tag and len(tag) == _TAG_DIGITS and value else text
        value, separator, tag = text.rpartition(_SEPARATOR)
        if not separator or not hmac.compare_digest(tag, self._key.record_tag(self._scope, name, value)):
            return self.warn_once(name, "is not signed with the job's secret")
        return value

    def warn_once(self, name: str, why: str) -> None:
        """One warning per key that a record under `name` was ignored, and why."""
        if name not in self._warned and len(self._warned) < _MAX_WARNED:
            self._warned.add(name)
            logger.warning("the rendezvous store's record %s %s: ignored (another process wrote it)", name[:80], why)

    def set(self, name: str, value: str) -> None:
        self.store.set(name, self.seal(name, value))

    def get(self, name: str) -> str | None:
        """The value under `name`; None when there is none, or it is not the job's."""
        if not self.store.check([name]):
            return None
        return self.open(name, self.store.get(name))

    def compare_set(self, name: str, value: str) -> str | None:
        """Write `value` under `name` unless a value is there already; the value there afterwards
        (None: what is there is not the job's, and stays)."""
        return self.open(name, self.store.compare_set(name, "", self.seal(name, value)))

    def raw(self, name: str) -> bytes:
        """What the store holds under `name`, unchecked (b"": nothing), to compare-and-set against."""
        return self.store.get(name) if self.store.check([name]) else b""

    def swap(self, name: str, expected: bytes, value: str) -> bytes:
        """Replace exactly `expected` (raw, from `raw`) with `value`; the raw value there afterwards."""
        return self.store.compare_set(name, expected, self.seal(name, value))
