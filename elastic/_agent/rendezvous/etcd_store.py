"""A c10d `Store` kept in etcd v3: what torchrun's agents share during a rendezvous.

The agent uses its store for the master address and port of each round, the
assignment of ranks, and the exit barrier. `EtcdStore` behaves as `TCPStore`
does for every method the agents call (tests/integration/test_etcd_store.py runs the
same checks against both):

- `get`, `wait` and `multi_get` block until every key exists, up to the store's
  timeout (or the given one), then raise `DistStoreError`. They wait on an etcd
  watch that starts at the revision of the read that found keys missing, so no
  write in between is missed and a waiting store costs etcd nothing;
- `multi_get` returns the values as of one etcd revision (a snapshot, however many
  keys: reads past 128 keys are pinned to the first read's revision);
- `add` creates a missing key at 0 and is atomic under concurrent clients;
- `compare_set(key, expected, desired)` on a missing key sets it only when
  `expected` is empty, and returns what the key holds afterwards (or `expected`);
- `append` creates a missing key; `delete_key` says whether a key was removed;
- `clone()` is another store on the same keys, with its own timeout;
  `has_extended_api()` is True, so torch calls `append`/`multi_get`/`multi_set`.

Keys live under one etcd prefix, values are the bytes given, and every write is
attached to the client's lease (`EtcdClient`), so a dead run's store expires.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

from torch.distributed import DistStoreError, Store
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from elastic._agent.rendezvous.etcd_client import EtcdClient
from elastic._agent.rendezvous.etcd_messages import (
    KeyValue,
    encode,
    txn_range_results,
    txn_revision,
)
from elastic._agent.timings import (
    FIRST_RETRY_SECONDS as _FIRST_RETRY_SECONDS,
    MAX_RETRY_SECONDS as _MAX_RETRY_SECONDS,
    MIN_READ_SECONDS as _MIN_READ_SECONDS,
)

# etcd refuses transactions of more operations than --max-txn-ops (default 128).
_MAX_TXN_OPS = 128


def _batches(items: list, size: int = _MAX_TXN_OPS) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _as_bytes(data: str | bytes) -> bytes:
    return data.encode() if isinstance(data, str) else bytes(data)


class EtcdStore(Store):
    """A c10d store under `prefix` in etcd, through `client`.

    `timeout` (how long `get`, `wait` and `multi_get` wait for a key) defaults to
    the client's `read_timeout` (60 s unless `--rdzv-conf` says otherwise), as
    torch's c10d backend gives its TCPStore, instead of c10d's 300 s: an agent
    whose peer died learns it within `read_timeout`.
    """

    def __init__(self, client: EtcdClient, prefix: bytes, timeout: timedelta | None = None) -> None:
        super().__init__()  # the pybind trampoline needs it
        self._client = client
        self._prefix = prefix if prefix.endswith(b"/") else prefix + b"/"
        # Markers that make a retried `add`/`append` count once; outside the
        # store's own prefix so `num_keys` does not see them.
        self._ops_prefix = self._prefix.rstrip(b"/") + b".ops/"
        self._clones: list[EtcdStore] = []
        self.set_timeout(timeout if timeout is not None else timedelta(seconds=client.options.read_timeout))

    def _key(self, key: str | bytes) -> bytes:
        return self._prefix + _as_bytes(key)

    def clone(self) -> EtcdStore:
        """Another store on the same keys and the same (thread-safe) etcd client; its
        timeout starts as this one's and is set independently.

        This store keeps its clones alive: torch's C++ side (`PrefixStore.clone()`,
        `_test_python_store`) holds only the C++ half of a store written in Python,
        and the Python half, which has the methods, would otherwise go at once."""
        twin = EtcdStore(self._client, self._prefix, self.timeout)
        self._clones.append(twin)
        return twin

    def has_extended_api(self) -> bool:
        return True

    # --- writes -----------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        self._client.txn([], [self._client.put_op(self._key(key), _as_bytes(value))], [], what="set a store key")

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError("multi_set needs as many values as keys")
        puts = [self._client.put_op(self._key(k), _as_bytes(v)) for k, v in zip(keys, values, strict=True)]
        for batch in _batches(puts):  # atomic per batch of 128: enough for the agent's use
            self._client.txn([], batch, [], what="set store keys")

    def add(self, key: str, amount: int) -> int:
        def added(current: KeyValue | None) -> bytes:
            try:
                base = int(current.value) if current else 0
            except ValueError:
                raise DistStoreError(f"store key {key!r} does not hold an integer, cannot add to it") from None
            return str(base + amount).encode()

        return int(self._read_modify_write(key, added, "add to a store key"))

    def append(self, key: str, value: str | bytes) -> None:
        self._read_modify_write(key, lambda current: (current.value if current else b"") + _as_bytes(value), "append to a store key")

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        expected, desired = _as_bytes(expected_value), _as_bytes(desired_value)
        etcd_key = encode(self._key(key))
        if expected:
            compare = {"key": etcd_key, "result": "EQUAL", "target": "VALUE", "value": encode(expected)}
        else:  # TCPStore: an empty expectation matches a missing key
            compare = {"key": etcd_key, "result": "EQUAL", "target": "CREATE", "create_revision": 0}
        reply = self._client.txn(
            [compare],
            [self._client.put_op(self._key(key), desired)],
            [EtcdClient.range_op(self._key(key))],
            what="compare-and-set a store key",
        )
        if reply.get("succeeded"):
            return desired
        kvs = txn_range_results(reply)[0]
        if kvs and not expected and kvs[0].value == b"":
            # TCPStore: an empty expectation also matches a key that holds b"".
            empty = {"key": etcd_key, "result": "EQUAL", "target": "MOD", "mod_revision": kvs[0].mod_revision}
            reply = self._client.txn([empty], [self._client.put_op(self._key(key), desired)],
                                     [EtcdClient.range_op(self._key(key))], what="compare-and-set a store key")
            if reply.get("succeeded"):
                return desired
            kvs = txn_range_results(reply)[0]
        return kvs[0].value if kvs else expected

    def delete_key(self, key: str) -> bool:
        return self._client.delete(self._key(key), what="delete a store key") > 0

    # --- reads ------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self._await([self._key(k) for k in keys], self._deadline(None))
        return [values[self._key(k)] for k in keys]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._await([self._key(k) for k in keys], self._deadline(timeout))

    def check(self, keys: list[str]) -> bool:
        values, _ = self._snapshot([self._key(k) for k in keys])
        return all(v is not None for v in values.values())

    def num_keys(self) -> int:
        reply = self._client.range(self._prefix, prefix=True, count_only=True, what="count store keys")
        return int(reply.get("count", 0))

    # Through `dist.PrefixStore` torch's bridge calls these two by their C++ names.
    deleteKey = delete_key  # noqa: N815
    getNumKeys = num_keys  # noqa: N815

    # --- waiting ------------------------------------------------------------------

    def _deadline(self, timeout: timedelta | None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else timeout).total_seconds()

    def _snapshot(self, keys: list[bytes], budget: float | None = None) -> tuple[dict[bytes, bytes | None], int]:
        """Every key's value (None: missing) as of one etcd revision, and that revision.

        One transaction per 128 keys; the first fixes the revision, the others read
        as of it, so the whole is one snapshot however many keys there are."""
        values: dict[bytes, bytes | None] = {}
        revision = 0
        for batch in _batches(list(dict.fromkeys(keys))):
            reads = [EtcdClient.range_op(k, revision=revision) for k in batch]
            reply = self._client.txn([], reads, [], what="read store keys", timeout=budget)
            revision = revision or txn_revision(reply)
            for key, kvs in zip(batch, txn_range_results(reply), strict=True):
                values[key] = kvs[0].value if kvs else None
        return values, revision

    def _await(self, keys: list[bytes], deadline: float) -> dict[bytes, bytes]:
        """The values of `keys` once all exist (as of one revision), or DistStoreError at `deadline`.

        Read; if keys are missing, watch the keys' range from the read's revision on
        until all exist. A failed read or a broken watch (etcd restarting, a token
        expiring) starts over with a read, until the deadline: a wait times out as
        a wait, whether etcd is down or not."""
        started = time.monotonic()
        pause = _FIRST_RETRY_SECONDS
        trouble: RendezvousConnectionError | None = None
        values: dict[bytes, bytes | None] = {}  # what the last read and watch saw
        while True:
            remaining = deadline - time.monotonic()
            try:
                values, revision = self._snapshot(keys, budget=max(remaining, _MIN_READ_SECONDS))
                if all(v is not None for v in values.values()):
                    return values  # type: ignore[return-value]
                if remaining > 0 and self._watch_until_present(values, revision, deadline):
                    return values  # type: ignore[return-value]
                trouble = None
            except RendezvousConnectionError as exc:
                trouble = exc
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._timed_out(keys, values, started, trouble)
            if trouble is not None:
                time.sleep(min(pause, remaining))
                pause = min(pause * 2, _MAX_RETRY_SECONDS)

    def _watch_until_present(self, values: dict[bytes, bytes | None], revision: int, deadline: float) -> bool:
        """Apply the changes after `revision` to `values` (a snapshot as of it) until
        every value is present (True) or the deadline passes (False).

        The watch covers the range from the smallest to the largest key, so a key
        deleted after the snapshot counts as missing again."""
        low, high = min(values), max(values) + b"\0"
        changes = self._client.watch(low, range_end=high, start_revision=revision + 1,
                                     timeout=deadline - time.monotonic(), what="wait for store keys")
        for batch in changes:
            for event in batch:
                if event.kv.key in values:
                    values[event.kv.key] = None if event.deleted else event.kv.value
            if all(v is not None for v in values.values()):
                changes.close()  # cancels the watch
                return True
        return False

    def _timed_out(self, keys: list[bytes], values: dict[bytes, bytes | None], started: float,
                   trouble: RendezvousConnectionError | None) -> None:
        """Raise the wait's DistStoreError (TCPStore's words), naming the missing keys."""
        missing = [k for k in dict.fromkeys(keys) if values.get(k) is None]
        names = ", ".join(k[len(self._prefix):].decode(errors="replace") for k in missing)
        waited = round((time.monotonic() - started) * 1000)
        detail = f"; {trouble}" if trouble else ""
        raise DistStoreError(f"wait timeout after {waited}ms, keys: {names} (etcd store{detail})")

    # --- read-modify-write -----------------------------------------------------------

    def _read_modify_write(self, key: str, update: Callable[[KeyValue | None], bytes], what: str) -> bytes:
        """Atomically replace a key's value with `update(current)`; returns the new value.

        Compare-and-set on the key's mod revision, retried on contention. The
        transaction also creates a one-off marker: if the client retries a request
        whose reply was lost, the marker shows it was applied, and it is not
        applied twice.
        """
        etcd_key = self._key(key)
        marker = self._ops_prefix + uuid.uuid4().hex.encode()
        while True:
            current = self._client.get(etcd_key, what=what)
            new_value = update(current)
            if current is None:
                key_unchanged = {"key": encode(etcd_key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
            else:
                key_unchanged = {"key": encode(etcd_key), "result": "EQUAL", "target": "MOD", "mod_revision": current.mod_revision}
            marker_absent = {"key": encode(marker), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
            reply = self._client.txn(
                [key_unchanged, marker_absent],
                [self._client.put_op(etcd_key, new_value), self._client.put_op(marker, new_value)],
                [EtcdClient.range_op(marker)],
                what=what,
            )
            if reply.get("succeeded"):
                return new_value
            applied = txn_range_results(reply)[0]
            if applied:
                return applied[0].value
            time.sleep(random.uniform(0, 0.01))  # contention: another client won this revision
