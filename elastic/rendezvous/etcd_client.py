"""The etcd v3 connection behind the `etcd-v3` rendezvous: options, failover, retries.

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

Requests and replies keep the shape of etcd's v3 JSON API (what the JSON gateway
took and gave: `{"request_put": {"key": <base64>, ...}}`, replies with
`header.revision`, `succeeded`, `responses`), so callers written against it read
the same; `key_values`, `txn_revision` and `txn_range_results` decode replies.

Invariant: a retried request may have been applied once already (a reply lost
in a restart). Every caller either sends idempotent requests or compare-and-set
transactions whose retry is harmless (see `EtcdStore.add`).
"""

from __future__ import annotations

import base64
import logging
import math
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format
from pyetcd import etcdrpc
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousParameters,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Marks a put's lease in a request built before sending (see `put_op`).
_CURRENT_LEASE = object()
DEFAULT_PORT = 2379
DEFAULT_TTL = 7200
DEFAULT_READ_TIMEOUT = 60.0
# One request never waits longer than this, so a silent endpoint is given up in
# favour of the next one while the operation's budget still has time left.
MAX_ATTEMPT_SECONDS = 5.0
MAX_BACKOFF_SECONDS = 1.0
# What closing the client may spend revoking its lease before leaving it to expire.
REVOKE_SECONDS = 5.0

_CHANNEL_OPTIONS = [
    # Only the options say where etcd is: no http(s)_proxy from the environment.
    ("grpc.enable_http_proxy", 0),
    # Reconnect within a second of etcd's return (gRPC's default waits up to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", int(MAX_BACKOFF_SECONDS * 1000)),
    # A range of many keys may exceed gRPC's default 4 MiB; etcd bounds it anyway.
    ("grpc.max_receive_message_length", 2**31 - 1),
]
# gRPC codes an etcd restart, a leader election or an overloaded member produce.
_TRANSIENT = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,  # RST_STREAM while a member shuts down
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # "etcdserver: too many requests"
}
# What gRPC says when TLS itself is wrong (waiting cannot cure it), as opposed to a
# handshake cut short by a restarting server ("Handshake read failed (Socket closed)").
_TLS_SIGNS = ("CERTIFICATE_VERIFY_FAILED", "security handshaker", "Unwrap failed", "SSL_ERROR_SSL")


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd holds it. Revisions are etcd's: 0 means 'never'."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int


@dataclass(frozen=True)
class WatchEvent:
    """One change seen by a watch: `kv` as written, or as deleted (then its value is
    empty and its `mod_revision` is the deletion's revision)."""

    deleted: bool
    kv: KeyValue


def parse_endpoints(text: str) -> tuple[Endpoint, ...]:
    """`h1:2379,h2,[::1]:2380` -> endpoints, port 2379 where none is given."""
    endpoints = []
    for part in (p.strip() for p in (text or "").split(",")):
        if not part:
            continue
        scheme, sep, rest = part.partition("://")
        if sep:  # http://h:2379 is what etcd's own flags look like: accept it
            if scheme not in ("http", "https"):
                raise ValueError(f"etcd endpoint {part!r}: only http:// or https:// (or no scheme)")
            part = rest.rstrip("/")
        if part.startswith("["):
            host, _, rest = part[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ""
        elif part.count(":") == 1:
            host, port_text = part.split(":")
        else:
            host, port_text = part, ""
        try:
            port = int(port_text) if port_text else DEFAULT_PORT
        except ValueError:
            raise ValueError(f"etcd endpoint {part!r} has a port that is not a number") from None
        if not host or not 0 < port < 65536:
            raise ValueError(f"etcd endpoint {part!r} is not HOST:PORT")
        endpoints.append(Endpoint(host, port))
    if not endpoints:
        raise ValueError("the etcd-v3 rendezvous needs --rdzv-endpoint=HOST:PORT[,HOST:PORT...]")
    return tuple(endpoints)


@dataclass(frozen=True)
class EtcdOptions:
    """What `--rdzv-endpoint`, `--rdzv-id` and `--rdzv-conf` say about etcd.

    The options are documented, as a table, in `elastic.rendezvous.etcd`.
    """

    endpoints: tuple[Endpoint, ...]
    key_prefix: str
    ttl: int
    read_timeout: float
    protocol: str = "http"
    ca_cert: str | None = None
    ssl_cert: str | None = None
    ssl_cert_key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> EtcdOptions:
        """Read and check the options; bad values raise ValueError with one clear line."""
        if not params.run_id:
            raise ValueError("the etcd-v3 rendezvous needs a non-empty --rdzv-id")
        prefix = (params.get("key_prefix") or f"/torchrevive/{params.run_id}").rstrip("/")
        if not prefix:
            raise ValueError("rdzv-conf key_prefix must not be empty")
        ttl = _positive(params, "ttl", DEFAULT_TTL, int)
        read_timeout = _positive(params, "read_timeout", DEFAULT_READ_TIMEOUT, float)
        protocol = (params.get("protocol") or "http").strip().lower()
        if protocol not in ("http", "https"):
            raise ValueError(f"rdzv-conf protocol must be http or https, not {protocol!r}")
        files = {name: params.get(name) for name in ("ca_cert", "ssl_cert", "ssl_cert_key", "password_file")}
        for name, path in files.items():
            if path and not Path(path).is_file():
                raise ValueError(f"rdzv-conf {name}: no such file {path}")
        if bool(files["ssl_cert"]) != bool(files["ssl_cert_key"]):
            raise ValueError("rdzv-conf ssl_cert and ssl_cert_key go together: give both or neither")
        if (files["ca_cert"] or files["ssl_cert"]) and protocol != "https":
            raise ValueError("rdzv-conf ca_cert/ssl_cert need protocol=https")
        user = params.get("user") or None
        password = params.get("password") or None
        if files["password_file"]:
            lines = Path(files["password_file"]).read_text().splitlines()
            password = lines[0] if lines else ""
        if password is not None and not user:
            raise ValueError("rdzv-conf password needs user")
        if user and password is None:
            raise ValueError("rdzv-conf user needs password or password_file")
        endpoints = parse_endpoints(params.endpoint)
        schemes = {p.strip().partition("://")[0] for p in params.endpoint.split(",") if "://" in p}
        if schemes - {protocol}:
            raise ValueError(
                f"--rdzv-endpoint says {'/'.join(sorted(schemes))}:// but the protocol is {protocol}: "
                f"add protocol={'/'.join(sorted(schemes))} to --rdzv-conf"
            )
        return cls(
            endpoints=endpoints,
            key_prefix=prefix,
            ttl=ttl,
            read_timeout=read_timeout,
            protocol=protocol,
            ca_cert=files["ca_cert"],
            ssl_cert=files["ssl_cert"],
            ssl_cert_key=files["ssl_cert_key"],
            user=user,
            password=password,
        )


def _positive(params: RendezvousParameters, name: str, default: T, kind: Callable[[str], T]) -> T:
    text = params.get(name)
    if text is None or text == "":
        return default
    what = "a positive integer" if kind is int else "a positive, finite number"
    try:
        value = kind(str(text))
    except ValueError:
        raise ValueError(f"rdzv-conf {name} must be {what}, not {text!r}") from None
    if not 0 < value < math.inf:  # type: ignore[operator]  # also rejects nan
        raise ValueError(f"rdzv-conf {name} must be {what}, not {text!r}")
    return value


# --- errors -------------------------------------------------------------------------


def _deadline_passed(exc: grpc.RpcError) -> bool:
    """The call's deadline ended it: gRPC's own, or etcd's copy of it, which may fire
    first and then arrives as UNKNOWN 'context deadline exceeded'."""
    return exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED or "context deadline exceeded" in (exc.details() or "")


def _transient(exc: grpc.RpcError) -> bool:
    """What an etcd restart, a leader election or an overloaded member looks like."""
    return exc.code() in _TRANSIENT or _deadline_passed(exc) or "Stream removed" in (exc.details() or "")


def _reason(exc: grpc.RpcError) -> str:
    """A short human reason from a gRPC error ('Connection refused', 'timed out')."""
    code, details = exc.code(), (exc.details() or "").strip()
    if _deadline_passed(exc):
        return "timed out"
    if details.startswith("etcdserver:") or not details:
        return details or code.name
    # 'failed to connect to all addresses; last error: UNKNOWN: ipv4:1.2.3.4:2379:
    # Failed to connect to remote host: Connection refused' -> 'Connection refused'
    parts = [p.strip() for p in details.split(": ") if p.strip() and p.strip() != "OK"]
    return parts[-1][:200] if parts else code.name


def _tls_reason(details: str) -> str | None:
    """What is wrong with TLS, if gRPC's message says TLS failed in a way waiting cannot cure."""
    if not any(sign in details for sign in _TLS_SIGNS):
        return None
    if "CERTIFICATE_VERIFY_FAILED" in details:
        verify = details[details.index("CERTIFICATE_VERIFY_FAILED"):]
        return verify.removesuffix(": OK").strip()[:200]
    if "Unwrap failed" in details:  # etcd ended the session right after the handshake
        return "etcd ended the TLS session; does it require a client certificate (ssl_cert, ssl_cert_key)?"
    return details.split("last error:")[-1].strip()[:200]


def _etcd_message(exc: grpc.RpcError) -> str:
    """etcd's own message, e.g. 'etcdserver: authentication failed, invalid user ID or password'."""
    return (exc.details() or exc.code().name).strip()


def _tls_credentials(options: EtcdOptions) -> grpc.ChannelCredentials | None:
    """Channel credentials for https, the files checked first so that a bad one is
    named in one line (gRPC would only say 'Failed to create security handshaker')."""
    if options.protocol != "https":
        return None
    checks = [("ca_cert", options.ca_cert, lambda c: c.load_verify_locations(cafile=options.ca_cert))]
    checks.append(("ssl_cert/ssl_cert_key", options.ssl_cert,
                   lambda c: c.load_cert_chain(options.ssl_cert, options.ssl_cert_key)))
    for name, path, load in checks:
        if path:
            try:
                load(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
            except (ssl.SSLError, OSError) as exc:
                raise RendezvousConnectionError(
                    f"etcd TLS failed: rdzv-conf {name} {path} is unusable ({getattr(exc, 'reason', None) or exc}); "
                    "give PEM files, the key matching the certificate"
                ) from None

    def read(path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return grpc.ssl_channel_credentials(read(options.ca_cert), read(options.ssl_cert_key), read(options.ssl_cert))


# --- the JSON API's shapes, to and from gRPC messages ----------------------------------


def encode(data: bytes) -> str:
    """Bytes as etcd's JSON API writes them (base64)."""
    return base64.b64encode(data).decode()


def decode(text: str) -> bytes:
    return base64.b64decode(text)


_RESULTS = etcdrpc.Compare.CompareResult
_TARGETS = etcdrpc.Compare.CompareTarget
_COMPARE_VALUES = {"version": int, "create_revision": int, "mod_revision": int, "lease": int, "value": decode}


def _compare(spec: dict[str, Any]) -> etcdrpc.Compare:
    """`{"key", "result", "target", <target field>}` (JSON API) -> a Compare message."""
    compare = etcdrpc.Compare(
        key=decode(spec["key"]),
        result=_RESULTS.Value(spec.get("result", "EQUAL")),
        target=_TARGETS.Value(spec.get("target", "VERSION")),
    )
    if "range_end" in spec:
        compare.range_end = decode(spec["range_end"])
    for name, convert in _COMPARE_VALUES.items():
        if name in spec:
            setattr(compare, name, convert(spec[name]))
    return compare


def _request_op(op: dict[str, Any], lease: int) -> etcdrpc.RequestOp:
    """A transaction operation (JSON API) -> a RequestOp message. Puts and reads of
    one key, what the rendezvous sends, go the quick way; anything else through
    protobuf's JSON parser."""
    put, read = op.get("request_put"), op.get("request_range")
    if put is not None and put.keys() <= {"key", "value", "lease"}:
        chosen = lease if put.get("lease") is _CURRENT_LEASE else int(put.get("lease", 0))
        return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(
            key=decode(put["key"]), value=decode(put.get("value", "")), lease=chosen))
    if read is not None and read.keys() <= {"key", "range_end", "revision"}:
        return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(
            key=decode(read["key"]), range_end=decode(read.get("range_end", "")), revision=int(read.get("revision", 0))))
    if put is not None and put.get("lease") is _CURRENT_LEASE:
        op = {**op, "request_put": {**put, "lease": lease}}
    return json_format.ParseDict(op, etcdrpc.RequestOp())


def _kv_json(kv: Any) -> dict[str, Any]:
    return {"key": encode(kv.key), "value": encode(kv.value), "create_revision": kv.create_revision,
            "mod_revision": kv.mod_revision, "version": kv.version, "lease": kv.lease}


def _range_json(reply: etcdrpc.RangeResponse) -> dict[str, Any]:
    return {"header": {"revision": reply.header.revision}, "kvs": [_kv_json(kv) for kv in reply.kvs],
            "count": reply.count, "more": reply.more}


def _txn_json(reply: etcdrpc.TxnResponse) -> dict[str, Any]:
    """A TxnResponse in the JSON API's shape (revisions as ints, keys and values base64)."""
    responses: list[dict[str, Any]] = []
    for response in reply.responses:
        kind = response.WhichOneof("response")
        if kind == "response_range":
            responses.append({kind: _range_json(response.response_range)})
        elif kind == "response_txn":
            responses.append({kind: _txn_json(response.response_txn)})
        else:
            responses.append({kind: json_format.MessageToDict(getattr(response, kind), preserving_proto_field_name=True)})
    return {"header": {"revision": reply.header.revision}, "succeeded": reply.succeeded, "responses": responses}


def _key_value(kv: Any) -> KeyValue:
    return KeyValue(key=kv.key, value=kv.value, create_revision=kv.create_revision, mod_revision=kv.mod_revision)


# --- the client ------------------------------------------------------------------------


class _Connection:
    """One endpoint's channel and the stubs on it (gRPC's are thread-safe)."""

    def __init__(self, endpoint: Endpoint, credentials: grpc.ChannelCredentials | None) -> None:
        self.endpoint = endpoint
        target = str(endpoint)
        if credentials is None:
            self.channel = grpc.insecure_channel(target, options=_CHANNEL_OPTIONS)
        else:
            self.channel = grpc.secure_channel(target, credentials, options=_CHANNEL_OPTIONS)
        self.kv = etcdrpc.KVStub(self.channel)
        self.lease = etcdrpc.LeaseStub(self.channel)
        self.auth = etcdrpc.AuthStub(self.channel)
        self.watch = etcdrpc.WatchStub(self.channel)


class EtcdClient:
    """A failover, retrying, authenticating etcd v3 client holding one lease.

    Thread-safe: the agent's threads, the lease keep-alive thread and stores cloned
    from one another share a client.
    """

    def __init__(self, options: EtcdOptions) -> None:
        self.options = options
        credentials = _tls_credentials(options)
        self._connections = [_Connection(e, credentials) for e in options.endpoints]
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
        self._keepalive = threading.Thread(target=self._keep_lease_alive, name="etcd-lease-keepalive", daemon=True)
        self._keepalive.start()

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

    def _call(self, what: str, request: Callable[[_Connection, float], T], *, retry_auth: bool = True,
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
                if tls := _tls_reason(details):
                    raise RendezvousConnectionError(
                        f"etcd at {endpoint}: TLS failed ({tls}); check protocol, ca_cert, ssl_cert and ssl_cert_key"
                    ) from None
                if _transient(exc):
                    failures[endpoint] = _reason(exc)
                    self._current = (index + 1) % len(self._connections)
                elif retry_auth and self.options.user and _token_expired(exc) and "auth" not in renewed:
                    renewed.add("auth")  # an expired token, or one from before etcd restarted
                    self._relogin(token)
                    continue
                elif "lease not found" in details and lease is not None and "lease" not in renewed:
                    renewed.add("lease")  # gone while etcd was out of reach longer than the ttl
                    self._renew_lease(lease, details)
                    continue
                else:
                    raise RendezvousConnectionError(f"etcd at {endpoint} refused to {what}: {_etcd_message(exc)}") from None
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

    def _authenticate(self, connection: _Connection, timeout: float) -> None:
        try:
            # Without the old token: a login must not depend on a stale one.
            reply = connection.auth.Authenticate(
                etcdrpc.AuthenticateRequest(name=self.options.user, password=self.options.password), timeout=timeout)
        except grpc.RpcError as exc:
            if _transient(exc) or _tls_reason(exc.details() or ""):
                raise
            raise RendezvousConnectionError(
                f"etcd at {connection.endpoint} rejected user {self.options.user!r}: {_etcd_message(exc)}"
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
        compares = [_compare(c) for c in compare]

        def send(connection: _Connection, attempt_timeout: float) -> etcdrpc.TxnResponse:
            lease = self.lease_id  # read per attempt: a lost lease is replaced between attempts
            request = etcdrpc.TxnRequest(
                compare=compares,
                success=[_request_op(op, lease) for op in success],
                failure=[_request_op(op, lease) for op in failure],
            )
            return connection.kv.Txn(request, timeout=attempt_timeout, metadata=self._metadata())

        return _txn_json(self._call(what, send, budget=timeout))

    def range(self, key: bytes, *, prefix: bool = False, count_only: bool = False, what: str = "read",
              timeout: float | None = None) -> dict[str, Any]:
        """The keys at `key` (or under it, with `prefix`), in the JSON API's shape."""
        request = etcdrpc.RangeRequest(key=key, range_end=prefix_end(key) if prefix else b"", count_only=count_only)
        reply = self._call(what, lambda c, t: c.kv.Range(request, timeout=t, metadata=self._metadata()), budget=timeout)
        return _range_json(reply)

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
                    yield [WatchEvent(deleted=e.type == e.DELETE, kv=_key_value(e.kv)) for e in reply.events]
        except grpc.RpcError as exc:
            if _deadline_passed(exc):
                return  # the caller's time is up: nothing changed
            if _transient(exc):
                self._current = (index + 1) % len(self._connections)
            raise RendezvousConnectionError(f"etcd at {connection.endpoint} broke a watch to {what}: {_reason(exc)}") from None
        finally:
            stream.cancel()

    # --- request builders ---------------------------------------------------------

    def put_op(self, key: bytes, value: bytes) -> dict[str, Any]:
        """A put for a transaction, attached to this client's lease (the lease's id
        is filled in when the request is sent: it changes if the lease is lost)."""
        return {"request_put": {"key": encode(key), "value": encode(value), "lease": _CURRENT_LEASE}}

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

    def _refresh(self, connection: _Connection, timeout: float) -> int:
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


def _token_expired(exc: grpc.RpcError) -> bool:
    """etcd refused the token: expired, from before a restart, or older than a change to its users."""
    return exc.code() == grpc.StatusCode.UNAUTHENTICATED or "auth" in (exc.details() or "")


def prefix_end(key: bytes) -> bytes:
    """The smallest key greater than every key that starts with `key` (etcd's range_end)."""
    stripped = key.rstrip(b"\xff")
    if not stripped:
        return b"\0"
    return stripped[:-1] + bytes([stripped[-1] + 1])


def key_values(range_reply: dict[str, Any]) -> list[KeyValue]:
    """The keys of a range reply, decoded (zero fields may be absent, as from the gateway)."""
    return [
        KeyValue(
            key=decode(kv["key"]),
            value=decode(kv.get("value", "")),
            create_revision=int(kv.get("create_revision", 0)),
            mod_revision=int(kv.get("mod_revision", 0)),
        )
        for kv in range_reply.get("kvs", [])
    ]


def txn_revision(reply: dict[str, Any]) -> int:
    """The store revision a transaction produced (the mod revision of what it put)."""
    return int(reply["header"]["revision"])


def txn_range_results(reply: dict[str, Any]) -> Sequence[list[KeyValue]]:
    """The keys returned by each range request of a transaction's taken branch."""
    return [key_values(r["response_range"]) for r in reply.get("responses", []) if "response_range" in r]
