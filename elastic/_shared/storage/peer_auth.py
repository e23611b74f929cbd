"""Signed snapshot traffic: what proves that a keeper request, and the bytes it carries, come from this job.

Every node of a job holds the same secret (`PeerKey`, at least 16 bytes), from:
- TORCHREVIVE_SNAPSHOT_SECRET_FILE, a file holding it (a k8s Secret mounts one), or
- TORCHREVIVE_SNAPSHOT_SECRET, the secret itself, or
- for a job on one host, a file torchrevive-run makes for the run (secret_files.py).

A request to a keeper carries three headers:

    X-Torchrevive-Time        unix seconds when it was signed
    X-Torchrevive-Nonce       32 hex digits, never used twice
    X-Torchrevive-Signature   HMAC-SHA256(secret, receiver, method, path, time, nonce,
                              Content-Length, X-Header-Bytes), hex

(the receiver: the `host:port` of the keeper's URL, as its workers and peers learn it, so a
request signed for one keeper is refused by every other keeper of the job)

and every body (a PUT's header and data, a GET's range) ends in a 16-byte tag:
Poly1305 under a one-time key, HMAC-SHA256(secret, what, nonce, and the response's
status and range for a GET), over every byte before it. Poly1305 runs at several
GB/s, so a restore's bytes are authenticated in full for little more than their crc32c
(benchmarks/snapshot_auth.py measures it).

Invariants:
- A request is judged before any of its body is read: unsigned is 401; a wrong
  signature (one made for another keeper included), a time outside +-`WINDOW`
  seconds of the keeper's clock, or a nonce already seen is 403 (`RequestVerifier`).
- A nonce is remembered until its signed time leaves the window (then the time
  check refuses it), so memory follows the job's own request rate (only requests
  whose signature verified are remembered) and a valid request is never refused
  for their number. Past `MAX_NONCES` the oldest signed second is forgotten and
  every request signed at or before it is refused: a replay is never accepted,
  and only a request signed before the newest `MAX_NONCES` of the window can be
  refused (`NonceMemory`).
- Nothing in a body is used before its tag verified: the keeper publishes a
  replica only after, and a reader returns a fetched range only after.
- A response's tag is bound to the request's nonce, its status and its range: a
  recorded answer cannot be replayed to another request.
- The secret never reaches a log, an exception, a command line or a repr.
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import secrets
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import urlsplit

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.poly1305 import Poly1305

from elastic._shared.timings import WINDOW

SECRET_FILE_ENV = "TORCHREVIVE_SNAPSHOT_SECRET_FILE"
SECRET_ENV = "TORCHREVIVE_SNAPSHOT_SECRET"
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
TIME, NONCE, SIGNATURE = "X-Torchrevive-Time", "X-Torchrevive-Nonce", "X-Torchrevive-Signature"
TAG_BYTES = 16
MAX_NONCES = 1 << 21
"""Nonces a verifier remembers at most (about 200 MB): 8,700 signed requests a second for the whole
window; past it the oldest second is forgotten (see `NonceMemory`)."""


class SecretError(ValueError):
    """The snapshot secret cannot be read or is unusable (one line; never contains the secret)."""


class PeerKey:
    """The job's secret, and the signatures and tags made with it."""

    __slots__ = ("_secret",)

    def __init__(self, secret: bytes) -> None:
        if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
            raise SecretError(f"a snapshot secret holds {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes, not {len(secret)}")
        self._secret = bytes(secret)

    def __repr__(self) -> str:
        return "PeerKey(<secret>)"

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> PeerKey | None:
        """The secret the environment names (its file first); None when it names none."""
        env = environ
        path = env.get(SECRET_FILE_ENV)
        if path:
            return cls.from_file(Path(path))
        value = env.get(SECRET_ENV)
        return cls(value.encode()) if value else None

    @classmethod
    def from_file(cls, path: Path) -> PeerKey:
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_SECRET_BYTES + 1)
        except OSError as exc:
            raise SecretError(f"cannot read the snapshot secret file {path}: {exc.strerror or exc}") from None
        return cls(raw.strip(b"\r\n"))

    # -- requests ----------------------------------------------------------------------

    def _request_mac(self, receiver: str, method: str, path: str, when: str, nonce: str, length: str, head: str) -> str:
        message = "\n".join(("torchrevive-request-2", receiver.lower(), method, path, when, nonce, length, head)).encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def sign(
        self, method: str, path: str, *, receiver: str, content_length: int = 0, header_bytes: int | None = None,
        now: float | None = None,
    ) -> dict[str, str]:
        """The headers that sign a request to the keeper `receiver` (`receiver_of` its URL; see the
        module docstring), at `now` (default: the clock)."""
        when, nonce = str(int(time.time() if now is None else now)), secrets.token_hex(16)
        head = "" if header_bytes is None else str(header_bytes)
        return {
            TIME: when, NONCE: nonce,
            SIGNATURE: self._request_mac(receiver, method, path, when, nonce, str(content_length), head),
        }

    def record_tag(self, scope: str, name: str, value: str) -> str:
        """The tag of a record kept in the rendezvous store (elastic._shared.storage.store_records):
        HMAC-SHA256 over its scope, key and value, 32 hex digits."""
        message = f"torchrevive-record-1\n{scope}\n{name}\n{value}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:32]

    def key_name(self, what: str) -> str:
        """A store key's name only the secret's holders can make (16 hex digits for `what`): HMAC-SHA256 in a
        domain of its own, so no tag a job publishes in the store ever equals one."""
        return hmac.new(self._secret, f"torchrevive-key-name-1\n{what}".encode(), hashlib.sha256).hexdigest()[:16]

    def store_tag(self, scope: bytes, name: bytes, value: bytes) -> bytes:
        """The tag of a value in a c10d store (elastic._shared.storage.sealed_store): HMAC-SHA256 over
        the scope (run, launch, round), the key and the value, its first 16 bytes. The scope and key are
        length-prefixed, so no two (scope, key, value) triples share a message."""
        message = b"torchrevive-store-1\n%d:%s%d:%s" % (len(scope), scope, len(name), name) + value
        return hmac.new(self._secret, message, hashlib.sha256).digest()[:16]

    # -- bodies ------------------------------------------------------------------------

    def body_tag(self, nonce: str, what: str) -> Poly1305:
        """A Poly1305 for one body: `what` says which (a PUT's body, a GET's response with its status and
        range); its one-time key is derived from the secret, the request's nonce and `what`."""
        key = hmac.new(self._secret, f"torchrevive-body-1\n{nonce}\n{what}".encode(), hashlib.sha256).digest()
        return Poly1305(key)


def check_tag(mac: Poly1305, tag: bytes) -> bool:
    """Whether `tag` is the one `mac` computed (compared in constant time)."""
    try:
        mac.verify(tag)
    except InvalidSignature:
        return False
    return True


def receiver_of(url: str) -> str:
    """Whom a request to `url` is signed for: its `host:port` (`[v6]:port`), as `receiver` names a keeper."""
    return urlsplit(url).netloc.lower()


def receiver(host: str, port: int) -> str:
    """The name a keeper bound on `host` (as its URL spells it) and `port` checks requests against."""
    return (f"[{host}]:{port}" if ":" in host else f"{host}:{port}").lower()


def put_what(path: str) -> str:
    return f"PUT {path}"


def response_what(path: str, status: int, start: int, stop: int, size: int) -> str:
    return f"GET {path} {status} {start}-{stop}/{size}"


class Refused(Exception):
    """A request a keeper must not serve: `status` (401 or 403) and why, for its debug log."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status


class NonceMemory:
    """The nonces of accepted requests, by the second they were signed (not thread-safe: the verifier locks).

    Invariant: a nonce is remembered until `time + window` has passed (after it the time check refuses
    the request), unless more than `limit` are held: then whole seconds go, oldest first, and `floor`
    (the newest second forgotten) refuses every request signed at or before it."""

    def __init__(self, window: float, limit: int = MAX_NONCES) -> None:
        self._window = window
        self._limit = limit
        self._by_second: dict[int, set[str]] = {}  # insertion order is not time order: `_oldest` sorts
        self._seconds: list[int] = []  # the keys of _by_second, oldest first
        self.count = 0
        self.floor = -1

    def add(self, nonce: str, when: int, now: float) -> str | None:
        """Remember `nonce`, signed at `when`; why it must be refused instead (None: it is new)."""
        self._expire(now)
        if when <= self.floor:
            return "signed before the oldest second the keeper still remembers (too many requests)"
        seen = self._by_second.get(when)
        if seen is not None and nonce in seen:
            return "replayed request"
        if seen is None:
            seen = self._by_second[when] = set()
            bisect.insort(self._seconds, when)
        seen.add(nonce)
        self.count += 1
        while self.count > self._limit and len(self._seconds) > 1:
            self._forget(self._seconds[0])  # never the newest second: a request of now is kept
        return None

    def _expire(self, now: float) -> None:
        while self._seconds and self._seconds[0] + self._window < now:
            self._forget(self._seconds[0], expired=True)

    def _forget(self, second: int, expired: bool = False) -> None:
        self._seconds.pop(0)
        self.count -= len(self._by_second.pop(second))
        if not expired:
            self.floor = max(self.floor, second)


class RequestVerifier:
    """A keeper's check of signed requests, with the nonces it has seen (thread-safe). `receiver`: the
    keeper's own name (`receiver`); `clock`: unix seconds (a test's own)."""

    def __init__(self, key: PeerKey, receiver: str, *, window: float = WINDOW, clock: Callable[[], float] = time.time,
                 max_nonces: int = MAX_NONCES) -> None:
        self._key = key
        self._receiver = receiver
        self._window = window
        self._clock = clock
        self._nonces = NonceMemory(window, max_nonces)
        self._lock = threading.Lock()

    @property
    def remembered(self) -> int:
        """How many nonces it holds now."""
        return self._nonces.count

    def check(self, method: str, path: str, headers: Mapping[str, str]) -> str:
        """The request's nonce, once its signature, time and nonce pass; else `Refused`."""
        when, nonce, signature = headers.get(TIME), headers.get(NONCE), headers.get(SIGNATURE)
        if not (when and nonce and signature):
            raise Refused(401, "unsigned request")
        if not (when.isascii() and when.isdigit() and len(when) <= 12 and len(nonce) == 32 and _is_hex(nonce)
                and len(signature) == 64 and _is_hex(signature)):
            raise Refused(403, "malformed signature headers")
        length = (headers.get("Content-Length") or "0").strip()
        head = (headers.get("X-Header-Bytes") or "").strip()
        expected = self._key._request_mac(self._receiver, method, path, when, nonce, length, head)
        if not hmac.compare_digest(expected, signature):
            raise Refused(403, "bad signature (or signed for another keeper)")
        now = self._clock()
        if abs(now - int(when)) > self._window:
            raise Refused(403, f"signed {now - int(when):+.0f} s from now, outside +-{self._window:g} s")
        with self._lock:
            why = self._nonces.add(nonce, int(when), now)
        if why is not None:
            raise Refused(403, why)
        return nonce


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


# -- optional TLS ----------------------------------------------------------------------

TLS_CERT_ENV = "TORCHREVIVE_SNAPSHOT_TLS_CERT"
TLS_KEY_ENV = "TORCHREVIVE_SNAPSHOT_TLS_KEY"
TLS_CA_ENV = "TORCHREVIVE_SNAPSHOT_TLS_CA"


def server_tls(environ: Mapping[str, str]) -> ssl.SSLContext | None:
    """A keeper's TLS context when TORCHREVIVE_SNAPSHOT_TLS_CERT and _KEY name its certificate and key
    (signing authenticates peers either way; TLS also hides the weights on the wire)."""
    env = environ
    cert, key = env.get(TLS_CERT_ENV), env.get(TLS_KEY_ENV)
    if not (cert or key):
        return None
    if not (cert and key):
        raise SecretError(f"snapshot TLS needs both {TLS_CERT_ENV} and {TLS_KEY_ENV}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise SecretError(f"cannot load the snapshot TLS certificate {cert}: {exc}") from None
    return context


def client_tls(environ: Mapping[str, str]) -> ssl.SSLContext:
    """How a worker checks a keeper's certificate: against TORCHREVIVE_SNAPSHOT_TLS_CA when set
    (keepers are reached by address, so the CA, the job's own, is what is checked, not a host name)."""
    env = environ
    ca = env.get(TLS_CA_ENV)
    context = ssl.create_default_context(cafile=ca) if ca else ssl.create_default_context()
    if ca:
        context.check_hostname = False
    return context
