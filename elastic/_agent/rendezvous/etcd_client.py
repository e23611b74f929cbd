"""The etcd v3 connection behind the `etcd-v3` rendezvous: failover, retries, auth, the lease.

`EtcdClient` speaks etcd's gRPC API, through the messages and stubs that
`etcd-sdk-python` (import `pyetcd`) generates from etcd's protos, and adds what a
rendezvous needs from a client and that library's own client class leaves out
(it never retries, refuses a failed endpoint for 300 s even once etcd is back,
drops the reason from connection errors, logs in once and only over TLS):

- several endpoints: a request that cannot reach one endpoint goes to the next at
  once; after a full round of failures it backs off and starts again, until the
  operation's budget (`read_timeout`) is spent. An etcd restart shorter than the
  budget is therefore invisible to callers.
- TLS from the options alone (`ca_cert`, `ssl_cert`, `ssl_cert_key`); proxies in
  the environment are ignored.
- etcd authentication: a token from `user`/`password`, renewed when etcd says it
  expired (simple tokens do not survive an etcd restart).
- one lease per client, kept alive by a daemon thread, to which every key written
  through `put_op` is attached: when every process of a run is gone, its keys
  disappear `ttl` seconds later; `close()` revokes it, so they go at once.
- watches (`watch`), so that waiting for a key costs etcd nothing while it waits.
- errors: what cannot be done becomes one-line `RendezvousConnectionError` naming
  the endpoint(s) and the reason, never a bare gRPC exception.

Its options come from etcd_options.py, its channels and the reading of gRPC's
errors from etcd_channel.py. Requests and replies keep the shape of
etcd's v3 JSON API (etcd_messages.py converts them), so callers written against
it read the same.

Invariant: a retried request may have been applied once already (a reply lost
in a restart). Every caller either sends idempotent requests or compare-and-set
transactions whose retry is harmless (see `EtcdStore.add`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from pyetcd import etcdrpc
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from elastic._agent.rendezvous.etcd_channel import (
    MAX_BACKOFF_SECONDS,
    Connection,
    deadline_passed,
    etcd_message,
    short_reason,
    tls_credentials,
    tls_reason,
    token_expired,
    transient,
)
from elastic._agent.rendezvous.etcd_messages import (
    CURRENT_LEASE,
    KeyValue,
    WatchEvent,
    compare_message,
    encode,
    key_value,
    key_values,
    prefix_end,
    range_json,
    request_op,
    txn_json,
)
from elastic._agent.rendezvous.etcd_options import EtcdOptions
from elastic._agent.timings import MAX_ATTEMPT_SECONDS, REVOKE_SECONDS
from elastic._shared.common import threads

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EtcdClient:
    """A failover, retrying, authenticating etcd v3 client holding one lease.

    Thread-safe: the agent's threads, the lease keep-alive thread and stores cloned
    from one another share a client.
    """

    def __init__(self, options: EtcdOptions) -> None:
        self.options = options
        credentials = tls_credentials(options)
        self._connections = [Connection(e, credentials) for e in options.endpoints]
        self._current = 0
        self._token: str | None = None
        self._auth_lock = threading.Lock()
        self._lease_lock = threading.Lock()
        self._closed = threading.Event()
        try:
            if options.user:
                self._call("authenticate", self._authenticate, retry_auth=False)
            self.lease_id = self._grant_lease()
        except BaseException:
            self._close_channels()
            raise
        # Stopped and joined at exit (elastic._shared.common.threads): after SIGTERM it may be inside gRPC's C++.
        self._keepalive = threads.start(self._keep_lease_alive, name="etcd-lease-keepalive", stop=self._closed.set)

    @property
    def endpoints_text(self) -> str:
        return ",".join(str(e) for e in self.options.endpoints)

    def close(self, *, revoke: bool = True) -> None:
        """Stop keeping the lease alive and disconnect. With `revoke` (a clean end),
        the lease is revoked and every key written through this client goes at once;
        without it (or when etcd cannot be reached within a few seconds) the keys
        stay until the lease's ttl runs out. Requests after `close` raise
        RendezvousConnectionError. Closing twice does nothing."""
        if self._closed.is_set():
            return
        self._closed.set()
        if revoke:
            try:
                self._call("revoke the lease", lambda c, timeout: c.lease.LeaseRevoke(
                    etcdrpc.LeaseRevokeRequest(ID=self.lease_id), timeout=timeout, metadata=self._metadata()),
                    budget=min(REVOKE_SECONDS, self.options.read_timeout), when_closed=True)
            except RendezvousConnectionError as exc:
                if "lease not found" not in str(exc):  # expired already: nothing left to revoke
                    logger.warning("%s; this process's keys expire in %d s instead", exc, self.options.ttl)
        self._close_channels()

    def _close_channels(self) -> None:
        for connection in self._connections:
            connection.channel.close()

    # --- requests ---------------------------------------------------------------

    def _call(self, what: str, request: Callable[[Connection, float], T], *, retry_auth: bool = True,
              budget: float | None = None, when_closed: bool = False) -> T:
        """Run `request(connection, attempt_timeout)` against the current endpoint,
        failing over and retrying what an etcd restart looks like (refused or reset
        connections, timeouts, 'etcdserver: leader changed') until the budget
        (`read_timeout`, or less) is spent. Expired tokens and lost leases are
        renewed once, then retried. Anything else raises at once."""
        started = time.monotonic()
        budget = self.options.read_timeout if budget is None else min(budget, self.options.read_timeout)
        deadline = started + budget
        attempt_timeout = min(MAX_ATTEMPT_SECONDS, max(budget, 0.001))
        backoff = 0.05
        failures: dict[str, str] = {}
        attempts = 0
        renewed: set[str] = set()
        while True:
            if self._closed.is_set() and not when_closed:
                raise RendezvousConnectionError(f"cannot {what}: the etcd client is closed")
            index = self._current
            connection = self._connections[index]
            endpoint = str(connection.endpoint)
            token, lease = self._token, getattr(self, "lease_id", None)
            try:
                reply = request(connection, attempt_timeout)
            except grpc.RpcError as exc:
                details = exc.details() or ""
                if tls := tls_reason(details):
                    raise RendezvousConnectionError(
                        f"etcd at {endpoint}: TLS failed ({tls}); check protocol, ca_cert, ssl_cert and ssl_cert_key"
                    ) from None
                if transient(exc):
                    failures[endpoint] = short_reason(exc)
                    self._current = (index + 1) % len(self._connections)
                elif retry_auth and self.options.user and token_expired(exc) and "auth" not in renewed:
                    renewed.add("auth")  # an expired token, or one from before etcd restarted
                    self._relogin(token)
                    continue
                elif "lease not found" in details and lease is not None and "lease" not in renewed:
                    renewed.add("lease")  # gone while etcd was out of reach longer than the ttl
                    self._renew_lease(lease, details)
                    continue
                else:
                    raise RendezvousConnectionError(f"etcd at {endpoint} refused to {what}: {etcd_message(exc)}") from None
            except ValueError:  # gRPC: 'Cannot invoke RPC on closed channel!'
                if self._closed.is_set():
                    raise RendezvousConnectionError(f"cannot {what}: the etcd client is closed") from None
                raise
            else:
                if failures:
                    seen = "; ".join(f"{e}: {r}" for e, r in failures.items())
                    logger.warning(
                        "etcd at %s was out of reach for %.1f s (%s); reconnected to %s",
                        ",".join(failures), time.monotonic() - started, seen, endpoint,
                    )
                return reply
            attempts += 1
            if attempts % len(self._connections) == 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RendezvousConnectionError(self._unreachable(what, budget, failures))
                time.sleep(min(backoff, remaining))
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)

    def _unreachable(self, what: str, budget: float, failures: dict[str, str]) -> str:
        """The one line that says no endpoint answered, with each one's reason."""
        seen = "; ".join(f"{e}: {r}" for e, r in failures.items())
        hint = ""
        if self.options.protocol == "http" and any("Socket closed" == r for r in failures.values()):
            hint = "; if etcd serves https, add protocol=https"
        elif self.options.protocol == "https" and any("Handshake read failed" in r for r in failures.values()):
            hint = "; if etcd serves plain http, drop protocol=https"
        return f"cannot reach etcd at {self.endpoints_text} to {what} within {budget:g} s ({seen}){hint}"

    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        token = self._token
        return (("token", token),) if token else None

    def _authenticate(self, connection: Connection, timeout: float) -> None:
        try:
            # Without the old token: a login must not depend on a stale one.
            reply = connection.auth.Authenticate(
                etcdrpc.AuthenticateRequest(name=self.options.user, password=self.options.password), timeout=timeout)
        except grpc.RpcError as exc:
            if transient(exc) or tls_reason(exc.details() or ""):
                raise
            raise RendezvousConnectionError(
                f"etcd at {connection.endpoint} rejected user {self.options.user!r}: {etcd_message(exc)}"
            ) from None
        self._token = reply.token

    def _relogin(self, stale_token: str | None) -> None:
        """Log in again, unless another thread already replaced `stale_token`."""
        with self._auth_lock:
            if self._token == stale_token:
                self._call("authenticate", self._authenticate, retry_auth=False)

    def txn(self, compare: list[dict], success: list[dict], failure: list[dict], what: str,
            *, timeout: float | None = None) -> dict[str, Any]:
        """One etcd transaction (operations as `put_op`/`range_op` build them, compares
        in the JSON API's shape); returns the reply in the JSON API's shape. `timeout`
        caps the budget (retries included) below `read_timeout`."""
        compares = [compare_message(c) for c in compare]

        def send(connection: Connection, attempt_timeout: float) -> etcdrpc.TxnResponse:
            lease = self.lease_id  # read per attempt: a lost lease is replaced between attempts
            request = etcdrpc.TxnRequest(
                compare=compares,
                success=[request_op(op, lease) for op in success],
                failure=[request_op(op, lease) for op in failure],
            )
            return connection.kv.Txn(request, timeout=attempt_timeout, metadata=self._metadata())

        return txn_json(self._call(what, send, budget=timeout))

    def range(self, key: bytes, *, prefix: bool = False, count_only: bool = False, what: str = "read",
              timeout: float | None = None) -> dict[str, Any]:
        """The keys at `key` (or under it, with `prefix`), in the JSON API's shape."""
        request = etcdrpc.RangeRequest(key=key, range_end=prefix_end(key) if prefix else b"", count_only=count_only)
        reply = self._call(what, lambda c, t: c.kv.Range(request, timeout=t, metadata=self._metadata()), budget=timeout)
        return range_json(reply)

    def get(self, key: bytes, what: str = "read") -> KeyValue | None:
        kvs = key_values(self.range(key, what=what))
        return kvs[0] if kvs else None

    def delete(self, key: bytes, *, prefix: bool = False, what: str = "delete") -> int:
        request = etcdrpc.DeleteRangeRequest(key=key, range_end=prefix_end(key) if prefix else b"")
        reply = self._call(what, lambda c, t: c.kv.DeleteRange(request, timeout=t, metadata=self._metadata()))
        return int(reply.deleted)

    def watch(self, key: bytes, *, range_end: bytes = b"", start_revision: int, timeout: float,
              what: str = "watch") -> Iterator[list[WatchEvent]]:
        """The changes to `key` (or to [key, range_end)) from `start_revision` on: one
        list per etcd reply (a revision's changes arrive together), until `timeout`
        seconds have passed, when the iteration ends.

        The stream is not retried: when it cannot be opened or breaks (etcd down, a
        compacted revision, an expired token) this raises RendezvousConnectionError,
        and the caller reads again (through the retrying requests) and watches from
        there. Leaving the iteration early cancels the watch."""
        index = self._current
        connection = self._connections[index]
        create = etcdrpc.WatchCreateRequest(key=key, range_end=range_end, start_revision=start_revision)
        try:
            stream = connection.watch.Watch(
                iter([etcdrpc.WatchRequest(create_request=create)]), timeout=max(timeout, 0.001), metadata=self._metadata())
        except ValueError:  # a closed channel
            raise RendezvousConnectionError(f"cannot {what}: the etcd client is closed") from None
        try:
            for reply in stream:
                if reply.canceled or reply.compact_revision:
                    reason = reply.cancel_reason or f"revision {start_revision} was compacted"
                    raise RendezvousConnectionError(f"etcd at {connection.endpoint} ended a watch to {what}: {reason}")
                if reply.events:
                    yield [WatchEvent(deleted=e.type == e.DELETE, kv=key_value(e.kv)) for e in reply.events]
        except grpc.RpcError as exc:
            if deadline_passed(exc):
                return  # the caller's time is up: nothing changed
            if transient(exc):
                self._current = (index + 1) % len(self._connections)
            raise RendezvousConnectionError(f"etcd at {connection.endpoint} broke a watch to {what}: {short_reason(exc)}") from None
        finally:
            stream.cancel()

    # --- request builders ---------------------------------------------------------

    def put_op(self, key: bytes, value: bytes) -> dict[str, Any]:
        """A put for a transaction, attached to this client's lease (the lease's id
        is filled in when the request is sent: it changes if the lease is lost)."""
        return {"request_put": {"key": encode(key), "value": encode(value), "lease": CURRENT_LEASE}}

    @staticmethod
    def range_op(key: bytes, *, revision: int = 0) -> dict[str, Any]:
        """A read of one key for a transaction; with `revision`, as it was then."""
        op: dict[str, Any] = {"key": encode(key)}
        if revision:
            op["revision"] = revision
        return {"request_range": op}

    # --- the lease ------------------------------------------------------------------

    def _renew_lease(self, lost: int, why: str) -> None:
        """Grant a new lease, unless another thread already replaced `lost`."""
        with self._lease_lock:
            if self.lease_id != lost or self._closed.is_set():
                return
            logger.warning("etcd lease %x is gone (%s); what this process wrote with it expired; granting a new one",
                           lost, why)
            self.lease_id = self._grant_lease()

    def _grant_lease(self) -> int:
        request = etcdrpc.LeaseGrantRequest(TTL=self.options.ttl, ID=0)
        reply = self._call("grant a lease", lambda c, t: c.lease.LeaseGrant(request, timeout=t, metadata=self._metadata()))
        return int(reply.ID)

    def _refresh(self, connection: Connection, timeout: float) -> int:
        """One keep-alive of the lease; returns the TTL etcd granted (<= 0: the lease is gone)."""
        request = etcdrpc.LeaseKeepAliveRequest(ID=self.lease_id)
        stream = connection.lease.LeaseKeepAlive(iter([request]), timeout=timeout, metadata=self._metadata())
        try:
            return int(next(stream).TTL)
        except StopIteration:
            raise RendezvousConnectionError(f"etcd at {connection.endpoint} ended a lease keep-alive unanswered") from None
        finally:
            stream.cancel()

    def _keep_lease_alive(self) -> None:
        interval = max(self.options.ttl / 3.0, 0.5)
        while not self._closed.wait(interval):
            lease = self.lease_id
            try:
                ttl = self._call("keep the lease alive", self._refresh)
                if ttl <= 0:
                    # etcd was out of reach for longer than the TTL: what this process
                    # wrote is gone; new writes get a new lease.
                    self._renew_lease(lease, "expired")
            except RendezvousConnectionError as exc:
                if not self._closed.is_set():
                    logger.warning("%s", exc)
