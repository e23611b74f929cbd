"""A c10d store whose every value is sealed with the job's secret and bound to where it belongs.

torch's stores (TCPStore, our EtcdStore) take anyone's writes. `SealedStore` wraps one, at the
narrowest seam every reader shares: the rendezvous handler hands torch's agent a `SealedStore` (so
the assigned ranks, MASTER_ADDR/MASTER_PORT, the exit barrier and our own notices go through it),
and a worker builds its process group on one (so gloo's addresses do). A value is stored as

    MAGIC (5 bytes) | NONCE (8 bytes) | TAG (16 bytes) | the value

TAG is `PeerKey.store_tag(scope, key, NONCE + value)`: HMAC-SHA256 with the job's secret over the
scope (the run id and launch id, and the round for a worker store: elastic._shared.protocol.round_identity),
the full key as the inner store holds it, a random nonce and the value. The nonce makes every write's
bytes its own, so a compare-and-set that returns them was this write's (two writers of the same value
would otherwise each take the other's success for theirs, and a counter would lose a count). Sealed is
not secret: anyone who reads the store reads the value (`peek`).

Invariants:
- A value that fails its check (a stranger's, one sealed for another key, run, launch or round, or
  written while the scope was unknown) reads as absent: `get`, `multi_get` and `wait` wait for the key
  to hold a value that verifies, until their timeout, then raise the `DistStoreError` the inner store
  raises for a missing key; `check` says False; `compare_set` and `add` treat it as a missing key (and
  replace it). It never raises anything else, so a forged value never becomes a new error in a
  caller's loop. One warning per key says it was ignored.
- Counters are sealed too: `add` and `append` are compare-and-set loops on sealed values, parsed
  here, never by the inner store. (A TCPStore parses an `add` on the server: a value that is not a
  number makes it drop the client's connection for good, which would end every agent sharing it.)
  A loop gives up with `DistStoreError` after `MAX_SWAPS` tries that others won.
- Without a secret (an unsigned job, asked for explicitly) a value carries no tag (`UNSIGNED` and a
  nonce) and is read unchecked, but counters are still parsed here: a value that is not a count reads
  as 0 and is replaced.
- A `SealedStore` lives as long as its process (`_ALIVE`): torch's C++ side (a `PrefixStore`, a process
  group) holds only the C++ half of a store written in Python, and the Python half, which has the
  methods, would otherwise go as soon as Python holds no reference (torch then fails in "pure virtual"
  or "Not implemented" calls). A process makes a few (one per handler, worker group and heal point).
- What is left: anyone who reaches the inner store can delete or rewrite keys (a stall: the caller's
  timeout), and write back a value the job wrote earlier under the same key in the same scope.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time
from collections.abc import Callable
from datetime import timedelta

from torch.distributed import DistStoreError, Store

from elastic._shared.storage.peer_auth import PeerKey
from elastic._shared.timings import POLL_FIRST, POLL_MAX

logger = logging.getLogger(__name__)

MAGIC = b"\x00trs2"
UNSIGNED = b"\x00tru2"
NONCE_BYTES = 8
TAG_BYTES = 16
HEADER = len(MAGIC) + NONCE_BYTES + TAG_BYTES
PROBE = b"\x00torchrevive-probe\x00"
"""What `compare_set(key, PROBE, PROBE)` returns for a missing key: a read that never blocks."""
MAX_SWAPS = 256
MAX_COUNT_DIGITS = 19
_MAX_WARNED = 256

_ALIVE: list[SealedStore] = []
"""Every SealedStore of this process (see the module docstring)."""

Scope = Callable[[], str | None]
"""The scope values are bound to; None while it is unknown (the agent's launch before its first round)."""


def _bytes(data: str | bytes) -> bytes:
    return data.encode() if isinstance(data, str) else bytes(data)


def _key_bytes(key: str | bytes) -> bytes:
    return key.encode("utf-8", "surrogateescape") if isinstance(key, str) else bytes(key)


def peek(raw: bytes) -> bytes:
    """The value a sealed `raw` holds, unchecked (sealed is not secret: a stranger reads it so)."""
    if raw.startswith(MAGIC) and len(raw) >= HEADER:
        return raw[HEADER:]
    if raw.startswith(UNSIGNED) and len(raw) >= len(UNSIGNED) + NONCE_BYTES:
        return raw[len(UNSIGNED) + NONCE_BYTES:]
    return raw


def probe(store: Store, key: str) -> bytes | None:
    """What `store` holds under `key` (None: nothing), without blocking and without writing: a
    compare-and-set that can never match (`PROBE`) returns the value, or `PROBE` when the key is missing."""
    raw = store.compare_set(key, PROBE, PROBE)
    return None if raw == PROBE else bytes(raw)


def parse_count(value: bytes | None) -> int | None:
    """`value` as a counter's integer (ASCII digits, an optional minus); None when it is not one."""
    if value is None:
        return 0
    text = value[1:] if value.startswith(b"-") else value
    if not (0 < len(text) <= MAX_COUNT_DIGITS and text.isdigit() and text.isascii()):
        return None
    return int(value)


class SealedStore(Store):
    """`inner` with every value sealed with `key` in `scope` (see the module docstring); `key` None:
    an unsigned job's store (values bare, counters still parsed here)."""

    def __init__(self, inner: Store, key: PeerKey | None, scope: Scope | str) -> None:
        super().__init__()  # the pybind trampoline needs it
        self.inner = inner
        self._key = key
        self._scope: Scope = (lambda: scope) if isinstance(scope, str) else scope
        self._warned: set[str] = set()
        self.refused = 0
        """Values read as absent so far (for tests and reports)."""
        self.set_timeout(inner.timeout)
        _ALIVE.append(self)

    @property
    def signed(self) -> bool:
        return self._key is not None

    def current_scope(self) -> str | None:
        """The scope values are sealed in now (None: not known yet, or no secret)."""
        return self._scope() if self._key is not None else None

    def clone(self) -> SealedStore:
        """Another sealed store on a clone of the inner one."""
        twin = SealedStore(self.inner.clone(), self._key, self._scope)
        twin.set_timeout(self.timeout)
        return twin

    def has_extended_api(self) -> bool:
        return True

    # --- sealing ----------------------------------------------------------------------

    def seal(self, key: str | bytes, value: str | bytes) -> bytes:
        """What the inner store holds for `value` under `key`."""
        data, nonce = _bytes(value), secrets.token_bytes(NONCE_BYTES)
        if self._key is None:
            return UNSIGNED + nonce + data
        scope = self._scope()
        if scope is None:
            raise DistStoreError(f"store key {str(key)[:120]}: nothing may be written before the launch is known")
        return MAGIC + nonce + self._key.store_tag(scope.encode(), _key_bytes(key), nonce + data) + data

    def open(self, key: str | bytes, raw: bytes, *, scope: str | None = None) -> bytes | None:
        """The value `raw` (read under `key`) holds; None, with one warning per key, when it does not verify.
        `scope`: check it in that scope instead of this store's (a launch this agent has not taken yet)."""
        if self._key is None:
            return peek(raw)
        scope = scope if scope is not None else self._scope()
        if scope is not None and raw.startswith(MAGIC) and len(raw) >= HEADER:
            nonce, tag = raw[len(MAGIC):len(MAGIC) + NONCE_BYTES], raw[len(MAGIC) + NONCE_BYTES:HEADER]
            value = raw[HEADER:]
            if hmac.compare_digest(tag, self._key.store_tag(scope.encode(), _key_bytes(key), nonce + value)):
                return value
        self.refused += 1
        name = str(key)[:120]
        if name not in self._warned and len(self._warned) < _MAX_WARNED:
            self._warned.add(name)
            logger.warning("store key %s holds a value not sealed with the job's secret for this run and launch "
                           "(a stranger's, or another launch's or round's): read as absent", name)
        return None

    # --- writes -----------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        self.inner.set(key, self.seal(key, value))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError("multi_set needs as many values as keys")
        self.inner.multi_set(keys, [self.seal(k, v) for k, v in zip(keys, values, strict=True)])

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """As TCPStore: write `desired` if the key holds `expected` (empty: if it is missing; a value that
        does not verify counts as missing); returns what it holds afterwards (`expected` when missing)."""
        expected, desired = _bytes(expected_value), _bytes(desired_value)

        def update(current: bytes | None) -> bytes | None:
            if (current or b"") == expected:
                return desired
            return None

        current, written = self._swap(key, update)
        if written:
            return desired
        return current if current is not None else expected

    def add(self, key: str, amount: int) -> int:
        def update(current: bytes | None) -> bytes | None:
            count = parse_count(current)
            if count is None:
                self._warn_not_a_count(key)
                count = 0
            if amount == 0 and current is not None:
                return None  # a read: nothing to write
            return str(count + amount).encode()

        current, written = self._swap(key, update)
        value = parse_count(current)
        return value if value is not None else 0

    def read_count(self, key: str) -> int | None:
        """The counter under `key`, as `add(key, 0)` returns it, but never written: None when the key is
        missing or its value does not verify or is not a count (a reader that must not bring back a key
        the job removed: the last agent of an etcd-v3 run removes the run's keys as it leaves)."""
        raw = self._probe(key)
        value = None if raw is None else self.open(key, raw)
        return None if value is None else parse_count(value)

    def append(self, key: str, value: str | bytes) -> None:
        tail = _bytes(value)
        self._swap(key, lambda current: (current or b"") + tail)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    # Through `dist.PrefixStore` torch's bridge calls these two by their C++ names.
    deleteKey = delete_key  # noqa: N815
    getNumKeys = num_keys  # noqa: N815

    # --- reads ------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        deadline = self._deadline(None)
        self._sync_timeout()
        return self._verified(key, self.inner.get(key), deadline)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        deadline = self._deadline(None)
        self._sync_timeout()
        raws = self.inner.multi_get(keys)
        return [self._verified(k, raw, deadline) for k, raw in zip(keys, raws, strict=True)]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        deadline = self._deadline(timeout)
        self.inner.wait(keys, self._left(deadline))
        if self._key is not None:
            for key in keys:
                self._verified(key, self._probe(key), deadline)

    def check(self, keys: list[str]) -> bool:
        if not self.inner.check(keys):
            return False
        if self._key is None:
            return True
        for key in keys:
            raw = self._probe(key)
            if raw is None or self.open(key, raw) is None:
                return False
        return True

    # --- helpers ----------------------------------------------------------------------

    def _probe(self, key: str) -> bytes | None:
        """What the inner store holds under `key` (None: nothing), without blocking."""
        return probe(self.inner, key)

    def _swap(self, key: str, update: Callable[[bytes | None], bytes | None]) -> tuple[bytes | None, bool]:
        """Replace the value under `key` (None when missing or not verified) with `update(value)`, by
        compare-and-set on the raw bytes read; (the value afterwards, whether this call wrote it)."""
        for _ in range(MAX_SWAPS):
            raw = self._probe(key)
            current = None if raw is None else self.open(key, raw)
            desired = update(current)
            if desired is None:
                return current, False
            sealed = self.seal(key, desired)
            if self.inner.compare_set(key, b"" if raw is None else raw, sealed) == sealed:
                return desired, True
        raise DistStoreError(f"store key {key[:120]} changed under {MAX_SWAPS} tries to update it")

    def _verified(self, key: str, raw: bytes | None, deadline: float) -> bytes:
        """The value under `key` once one verifies (`raw` is the first look); DistStoreError at `deadline`."""
        pause = POLL_FIRST
        while True:
            value = None if raw is None else self.open(key, raw)
            if value is not None:
                return value
            left = deadline - time.monotonic()
            if left <= 0:
                raise DistStoreError(f"wait timeout: store key {key[:120]} holds no value sealed with the job's "
                                     "secret for this run and launch")
            time.sleep(min(pause, left))
            pause = min(pause * 2, POLL_MAX)
            raw = self._probe(key)

    def _deadline(self, timeout: timedelta | None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else timeout).total_seconds()

    @staticmethod
    def _left(deadline: float) -> timedelta:
        return timedelta(seconds=max(0.001, deadline - time.monotonic()))

    def _sync_timeout(self) -> None:
        """The inner store's own blocking reads wait as long as this store's timeout says (torch sets it
        on the store it was handed: this one)."""
        if self.inner.timeout != self.timeout:
            self.inner.set_timeout(self.timeout)

    def _warn_not_a_count(self, key: str) -> None:
        name = f"{key[:120]} (count)"
        if name not in self._warned and len(self._warned) < _MAX_WARNED:
            self._warned.add(name)
            logger.warning("store key %s does not hold a count: read as 0", key[:120])

