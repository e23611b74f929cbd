"""A c10d `Store` kept in etcd v3: what torchrun's agents share during a rendezvous.

The agent uses its store for the master address and port of each round, the
assignment of ranks, and the exit barrier. `EtcdStore` behaves as `TCPStore`
does for every method the agents call (tests/unit/test_etcd_store.py runs the
same checks against both):

- `get`, `wait` and `multi_get` block until every key exists, up to the store's
  timeout (or the given one), then raise `DistStoreError`;
- `add` creates a missing key at 0 and is atomic under concurrent clients;
- `compare_set(key, expected, desired)` on a missing key sets it only when
  `expected` is empty, and returns what the key holds afterwards (or `expected`);
- `append` creates a missing key; `delete_key` says whether a key was removed.

Keys live under one etcd prefix, values are the bytes given, and every write is
attached to the client's lease (`EtcdClient`), so a dead run's store expires.
"""

from __future__ import annotations

import random
import time
import uuid
from datetime import timedelta

from etcd3gw.utils import _encode
from torch.distributed import DistStoreError, Store
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from elastic.rendezvous.etcd_client import EtcdClient, KeyValue, txn_range_results

# Polling a missing key: start fast (a rendezvous waits on keys that usually
# arrive within milliseconds), back off so idle waiters cost etcd little.
_FIRST_POLL_SECONDS = 0.005
_MAX_POLL_SECONDS = 0.1
# etcd refuses transactions of more operations than --max-txn-ops (default 128).
_MAX_TXN_OPS = 128


def _batches(items: list, size: int = _MAX_TXN_OPS) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _as_bytes(data: str | bytes) -> bytes:
    return data.encode() if isinstance(data, str) else bytes(data)


class EtcdStore(Store):
    """A c10d store under `prefix` in etcd, through `client`."""

    def __init__(self, client: EtcdClient, prefix: bytes, timeout: timedelta | None = None) -> None:
        super().__init__()  # the pybind trampoline needs it
        self._client = client
        self._prefix = prefix if prefix.endswith(b"/") else prefix + b"/"
        # Markers that make a retried `add`/`append` count once; outside the
        # store's own prefix so `num_keys` does not see them.
        self._ops_prefix = self._prefix.rstrip(b"/") + b".ops/"
        if timeout is not None:
            self.set_timeout(timeout)

    def _key(self, key: str | bytes) -> bytes:
        return self._prefix + _as_bytes(key)

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
        etcd_key = _encode(self._key(key))
        if expected:
            compare = {"key": etcd_key, "result": "EQUAL", "target": "VALUE", "value": _encode(expected)}
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
        deadline = self._deadline(None)
        while True:
            self._wait_until_present(keys, deadline)
            found = self._read(keys)
            if all(kv is not None for kv in found):
                return [kv.value for kv in found]  # type: ignore[union-attr]
            # A key went away between the wait and the read: wait again.

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_until_present(keys, self._deadline(timeout))

    def check(self, keys: list[str]) -> bool:
        return all(kv is not None for kv in self._read(keys))

    def num_keys(self) -> int:
        reply = self._client.range(self._prefix, prefix=True, count_only=True, what="count store keys")
        return int(reply.get("count", 0))

    # Through `dist.PrefixStore` torch's bridge calls these two by their C++ names.
    deleteKey = delete_key  # noqa: N815
    getNumKeys = num_keys  # noqa: N815

    # --- helpers ------------------------------------------------------------------

    def _deadline(self, timeout: timedelta | None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else timeout).total_seconds()

    def _read(self, keys: list[str]) -> list[KeyValue | None]:
        """All keys in one transaction: a consistent snapshot."""
        found: list[KeyValue | None] = []
        for batch in _batches(list(keys)):
            reply = self._client.txn([], [EtcdClient.range_op(self._key(k)) for k in batch], [], what="read store keys")
            found += [kvs[0] if kvs else None for kvs in txn_range_results(reply)]
        return found

    def _wait_until_present(self, keys: list[str], deadline: float) -> None:
        pause = _FIRST_POLL_SECONDS
        started = time.monotonic()
        while True:
            try:
                missing = [k for k, kv in zip(keys, self._read(keys), strict=True) if kv is None]
                unreachable = None
            except RendezvousConnectionError as exc:  # a wait times out as a wait, etcd down or not
                missing, unreachable = list(keys), exc
            if not missing:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                waited = round((time.monotonic() - started) * 1000)
                raise DistStoreError(
                    f"wait timeout after {waited}ms, keys: {', '.join(missing)} (etcd store"
                    + (f"; {unreachable})" if unreachable else ")")
                ) from unreachable
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, _MAX_POLL_SECONDS)

    def _read_modify_write(self, key: str, update, what: str) -> bytes:
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
                key_unchanged = {"key": _encode(etcd_key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
            else:
                key_unchanged = {"key": _encode(etcd_key), "result": "EQUAL", "target": "MOD", "mod_revision": current.mod_revision}
            marker_absent = {"key": _encode(marker), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
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

