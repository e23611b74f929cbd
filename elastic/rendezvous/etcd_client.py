"""The etcd v3 connection behind the `etcd-v3` rendezvous: options, failover, retries.

`EtcdClient` speaks etcd's v3 JSON gateway through `etcd3gw` and adds what a
rendezvous needs from a client and etcd3gw leaves out:

- several endpoints: a request that cannot reach one endpoint goes to the next at
  once; after a full round of failures it backs off and starts again, until the
  operation's budget (`read_timeout`) is spent. An etcd restart shorter than the
  budget is therefore invisible to callers.
- etcd authentication: a token from `user`/`password`, renewed when etcd says it
  expired.
- one lease per client, kept alive by a daemon thread, to which every key written
  through the client is attached: when every process of a run is gone, its keys
  disappear `ttl` seconds later.
- errors: what cannot be done becomes `RendezvousConnectionError` naming the
  endpoint(s) and the reason, never a bare HTTP or etcd3gw exception.

Invariant: a retried request may have been applied once already (a reply lost
in a restart). Every caller either sends idempotent requests or compare-and-set
transactions whose retry is harmless (see `EtcdStore.add`).
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import requests
from etcd3gw import exceptions as etcd_exceptions
from etcd3gw.client import Etcd3Client
from etcd3gw.utils import _decode, _encode
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
# One HTTP request never waits longer than this, so a silent endpoint is given up
# in favour of the next one while the operation's budget still has time left.
MAX_ATTEMPT_SECONDS = 5.0
MAX_BACKOFF_SECONDS = 1.0


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


_ERRNO = re.compile(r"\[Errno -?\d+\] ([^'\")]+)")


def _reason(exc: BaseException) -> str:
    """A short human reason from a requests/etcd3gw error ('Connection refused')."""
    text = f"{exc} {getattr(exc, 'detail_text', '') or ''}"
    if match := _ERRNO.search(text):
        return match.group(1).strip()
    if isinstance(exc, etcd_exceptions.ConnectionTimeoutError) or "timed out" in text.lower():
        return "timed out"
    return etcd_message(exc) or type(exc).__name__


def _tls_is_misconfigured(exc: BaseException) -> bool:
    """A TLS failure that retrying cannot cure (verification, keys), as opposed to a
    handshake cut short by a restarting server ('EOF occurred in violation of protocol')."""
    text = str(exc).upper()
    return any(sign in text for sign in ("VERIFY", "ALERT", "KEY_VALUES_MISMATCH", "PEM", "NO_CERTIFICATE", "WRONG_VERSION"))


def _tls_reason(exc: BaseException) -> str:
    """The useful part of an SSL error ('CERTIFICATE_VERIFY_FAILED', 'tlsv13 alert ...')."""
    text = str(exc)
    match = re.search(r"\[(?:SSL|X509|PEM): ([A-Z_]+)\]|(tlsv\d+ alert [a-z ]+)|(certificate verify failed[^(]*)|\[SSL\] ([^(']+)", text)
    if match:
        return next(g for g in match.groups() if g).strip()
    return text[:200]


def etcd_message(exc: BaseException) -> str:
    """etcd's own message from a gateway error body, e.g. 'etcdserver: user name not found'."""
    detail = getattr(exc, "detail_text", None) or ""
    match = re.search(r'"(?:message|error)"\s*:\s*"([^"]+)"', detail)
    return match.group(1) if match else detail.strip()[:200]


class EtcdClient:
    """A failover, retrying, authenticating etcd v3 client holding one lease.

    Thread-safe for the ways the rendezvous uses it (the agent's thread plus the
    lease keep-alive thread).
    """

    def __init__(self, options: EtcdOptions) -> None:
        self.options = options
        session = requests.Session()
        # Where etcd is and whom to trust come from the options alone: with the
        # environment trusted, REQUESTS_CA_BUNDLE would silently replace ca_cert
        # and an HTTP_PROXY would carry the rendezvous.
        session.trust_env = False
        if options.ca_cert:
            session.verify = options.ca_cert
        if options.ssl_cert and options.ssl_cert_key:
            session.cert = (options.ssl_cert, options.ssl_cert_key)
        self._session = session
        attempt_timeout = min(options.read_timeout, MAX_ATTEMPT_SECONDS)
        self._clients = [
            Etcd3Client(e.host, e.port, protocol=options.protocol, timeout=attempt_timeout, api_path="/v3/", session=session)
            for e in options.endpoints
        ]
        self._current = 0
        self._auth_lock = threading.Lock()
        self._lease_lock = threading.Lock()
        self._closed = threading.Event()
        if options.user:
            self._call("authenticate", self._authenticate, retry_auth=False)
        self.lease_id = self._grant_lease()
        self._keepalive = threading.Thread(target=self._keep_lease_alive, name="etcd-lease-keepalive", daemon=True)
        self._keepalive.start()

    @property
    def endpoints_text(self) -> str:
        return ",".join(str(e) for e in self.options.endpoints)

    def close(self) -> None:
        """Stop keeping the lease alive. Keys stay until the lease's TTL runs out:
        other processes of the run may still be reading them."""
        self._closed.set()

    # --- requests ---------------------------------------------------------------

    def _call(self, what: str, request: Callable[[Etcd3Client], T], *, retry_auth: bool = True) -> T:
        """Run `request` against the current endpoint, failing over and retrying
        what an etcd restart looks like (refused or reset connections, TLS
        handshakes cut short, the gateway's 500s and 503s) until `read_timeout`
        is spent. Expired tokens and lost leases are renewed, then retried."""
        started = time.monotonic()
        deadline = started + self.options.read_timeout
        backoff = 0.05
        failures: dict[str, str] = {}
        attempts = 0
        renewed: set[str] = set()
        while True:
            index = self._current
            client = self._clients[index]
            endpoint = str(self.options.endpoints[index])
            try:
                reply = request(client)
            except (etcd_exceptions.ConnectionFailedError, etcd_exceptions.ConnectionTimeoutError) as exc:
                cause = exc.__context__
                if isinstance(cause, requests.exceptions.SSLError) and _tls_is_misconfigured(cause):
                    # A certificate does not become valid by waiting: say so now.
                    raise RendezvousConnectionError(
                        f"etcd at {endpoint}: TLS failed ({_tls_reason(cause)}); "
                        "check protocol, ca_cert, ssl_cert and ssl_cert_key"
                    ) from exc
                failures[endpoint] = _reason(exc)
                self._current = (index + 1) % len(self._clients)
            except etcd_exceptions.InternalServerError as exc:
                # The gateway answers 500 while the etcd behind it restarts.
                failures[endpoint] = etcd_message(exc) or "internal server error"
                self._current = (index + 1) % len(self._clients)
            except etcd_exceptions.Etcd3Exception as exc:
                message = etcd_message(exc)
                if retry_auth and self.options.user and "auth" in message and "auth" not in renewed:
                    renewed.add("auth")  # an expired token, or one from before etcd restarted
                    self._call("authenticate", self._authenticate, retry_auth=False)
                    continue
                if "lease not found" in message and "lease" not in renewed:
                    renewed.add("lease")  # gone while etcd was out of reach longer than the ttl
                    self._renew_lease(message)
                    continue
                raise RendezvousConnectionError(f"etcd at {endpoint} refused to {what}: {message or exc}") from exc
            except (requests.exceptions.RequestException, ValueError) as exc:
                # A reply cut off mid-body (ChunkedEncodingError, bad JSON) while etcd stops.
                failures[endpoint] = type(exc).__name__
                self._current = (index + 1) % len(self._clients)
            else:
                if failures:
                    seen = "; ".join(f"{e}: {r}" for e, r in failures.items())
                    logger.warning(
                        "etcd at %s was out of reach for %.1f s (%s); reconnected to %s",
                        ",".join(failures), time.monotonic() - started, seen, endpoint,
                    )
                return reply
            attempts += 1
            if attempts % len(self._clients) == 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    seen = "; ".join(f"{e}: {r}" for e, r in failures.items())
                    hint = ""
                    if self.options.protocol == "http" and any("closed connection" in r for r in failures.values()):
                        hint = "; if etcd serves https, add protocol=https"
                    raise RendezvousConnectionError(
                        f"cannot reach etcd at {self.endpoints_text} to {what} within "
                        f"{self.options.read_timeout:g} s ({seen}){hint}"
                    )
                time.sleep(min(backoff, remaining))
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)

    def _authenticate(self, client: Etcd3Client) -> None:
        with self._auth_lock:
            try:
                # Without the old token: etcd refuses a login that carries a stale one.
                reply = client.post(
                    client.get_url("/auth/authenticate"),
                    json={"name": self.options.user, "password": self.options.password},
                    headers={"Authorization": None},
                )
            except (etcd_exceptions.ConnectionFailedError, etcd_exceptions.ConnectionTimeoutError):
                raise
            except etcd_exceptions.Etcd3Exception as exc:
                raise RendezvousConnectionError(
                    f"etcd at {client.host}:{client.port} rejected user {self.options.user!r}: {etcd_message(exc)}"
                ) from exc
            self._session.headers["Authorization"] = reply["token"]

    def txn(self, compare: list[dict], success: list[dict], failure: list[dict], what: str) -> dict[str, Any]:
        """One etcd transaction; returns the gateway's reply."""
        payload = {"compare": compare, "success": success, "failure": failure}
        return self._call(what, lambda c: c.transaction(self._with_lease(payload)))

    def _with_lease(self, payload: dict[str, Any]) -> dict[str, Any]:
        lease = self.lease_id

        def fill(ops: list[dict]) -> list[dict]:
            return [
                {"request_put": {**op["request_put"], "lease": lease}}
                if op.get("request_put", {}).get("lease") is _CURRENT_LEASE else op
                for op in ops
            ]

        return {**payload, "success": fill(payload["success"]), "failure": fill(payload["failure"])}

    def range(self, key: bytes, *, prefix: bool = False, count_only: bool = False, what: str = "read") -> dict[str, Any]:
        payload: dict[str, Any] = {"key": _encode(key)}
        if prefix:
            payload["range_end"] = _encode(prefix_end(key))
        if count_only:
            payload["count_only"] = True
        return self._call(what, lambda c: c.post(c.get_url("/kv/range"), json=payload))

    def get(self, key: bytes, what: str = "read") -> KeyValue | None:
        kvs = key_values(self.range(key, what=what))
        return kvs[0] if kvs else None

    def delete(self, key: bytes, *, prefix: bool = False, what: str = "delete") -> int:
        payload: dict[str, Any] = {"key": _encode(key)}
        if prefix:
            payload["range_end"] = _encode(prefix_end(key))
        reply = self._call(what, lambda c: c.post(c.get_url("/kv/deleterange"), json=payload))
        return int(reply.get("deleted", 0))

    # --- request builders ---------------------------------------------------------

    def put_op(self, key: bytes, value: bytes) -> dict[str, Any]:
        """A put for a transaction, attached to this client's lease (the lease's id
        is filled in when the request is sent: it changes if the lease is lost)."""
        return {"request_put": {"key": _encode(key), "value": _encode(value), "lease": _CURRENT_LEASE}}

    @staticmethod
    def range_op(key: bytes) -> dict[str, Any]:
        return {"request_range": {"key": _encode(key)}}

    # --- the lease ------------------------------------------------------------------

    def _renew_lease(self, why: str) -> None:
        with self._lease_lock:
            logger.warning("etcd lease %x is gone (%s); what this process wrote with it expired; granting a new one",
                           self.lease_id, why)
            self.lease_id = self._grant_lease()

    def _grant_lease(self) -> int:
        reply = self._call(
            "grant a lease",
            lambda c: c.post(c.get_url("/lease/grant"), json={"TTL": self.options.ttl, "ID": 0}),
        )
        return int(reply["ID"])

    def _keep_lease_alive(self) -> None:
        interval = max(self.options.ttl / 3.0, 0.5)
        while not self._closed.wait(interval):
            try:
                reply = self._call(
                    "keep the lease alive",
                    lambda c: c.post(c.get_url("/lease/keepalive"), json={"ID": self.lease_id}),
                )
            except RendezvousConnectionError as exc:
                logger.warning("%s", exc)
                continue
            if int(reply.get("result", {}).get("TTL", -1)) <= 0 and not self._closed.is_set():
                # etcd was out of reach for longer than the TTL: what this process
                # wrote is gone; new writes get a new lease.
                logger.warning("etcd lease %x expired; its keys are gone, granting a new one", self.lease_id)
                try:
                    self.lease_id = self._grant_lease()
                except RendezvousConnectionError as exc:
                    logger.warning("%s", exc)


def prefix_end(key: bytes) -> bytes:
    """The smallest key greater than every key that starts with `key` (etcd's range_end)."""
    stripped = key.rstrip(b"\xff")
    if not stripped:
        return b"\0"
    return stripped[:-1] + bytes([stripped[-1] + 1])


def key_values(range_reply: dict[str, Any]) -> list[KeyValue]:
    """The keys of a range reply, decoded (the gateway omits zero fields)."""
    return [
        KeyValue(
            key=_decode(kv["key"]),
            value=_decode(kv.get("value", "")),
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
