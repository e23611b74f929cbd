"""One etcd endpoint's gRPC channel, and what its errors mean.

`EtcdClient` (etcd_client.py) fails over between these connections and retries;
this module holds what it decides with: the channel's options, TLS credentials
built from `--rdzv-conf` alone, and the reading of a gRPC error as transient
(an etcd restart, a leader election, an overloaded member: worth another try),
a TLS mistake (waiting cannot cure it), or an expired token.

Invariant: what a person reads from here is one short line (`short_reason`,
`tls_reason`, `etcd_message`), never a gRPC dump.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc
from pyetcd import etcdrpc
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from elastic._agent.rendezvous.etcd_options import Endpoint, EtcdOptions
from elastic._agent.timings import MAX_BACKOFF_SECONDS

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


class Connection:
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


def tls_credentials(options: EtcdOptions) -> grpc.ChannelCredentials | None:
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


# --- errors -------------------------------------------------------------------------


def deadline_passed(exc: grpc.RpcError) -> bool:
    """The call's deadline ended it: gRPC's own, or etcd's copy of it, which may fire
    first and then arrives as UNKNOWN 'context deadline exceeded'."""
    return exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED or "context deadline exceeded" in (exc.details() or "")


def transient(exc: grpc.RpcError) -> bool:
    """What an etcd restart, a leader election or an overloaded member looks like."""
    return exc.code() in _TRANSIENT or deadline_passed(exc) or "Stream removed" in (exc.details() or "")


def short_reason(exc: grpc.RpcError) -> str:
    """A short human reason from a gRPC error ('Connection refused', 'timed out')."""
    code, details = exc.code(), (exc.details() or "").strip()
    if deadline_passed(exc):
        return "timed out"
    if details.startswith("etcdserver:") or not details:
        return details or code.name
    # 'failed to connect to all addresses; last error: UNKNOWN: ipv4:1.2.3.4:2379:
    # Failed to connect to remote host: Connection refused' -> 'Connection refused'
    parts = [p.strip() for p in details.split(": ") if p.strip() and p.strip() != "OK"]
    return parts[-1][:200] if parts else code.name


def tls_reason(details: str) -> str | None:
    """What is wrong with TLS, if gRPC's message says TLS failed in a way waiting cannot cure."""
    if not any(sign in details for sign in _TLS_SIGNS):
        return None
    if "CERTIFICATE_VERIFY_FAILED" in details:
        verify = details[details.index("CERTIFICATE_VERIFY_FAILED"):]
        return verify.removesuffix(": OK").strip()[:200]
    if "Unwrap failed" in details:  # etcd ended the session right after the handshake
        return "etcd ended the TLS session; does it require a client certificate (ssl_cert, ssl_cert_key)?"
    return details.split("last error:")[-1].strip()[:200]


def etcd_message(exc: grpc.RpcError) -> str:
    """etcd's own message, e.g. 'etcdserver: authentication failed, invalid user ID or password'."""
    return (exc.details() or exc.code().name).strip()


def token_expired(exc: grpc.RpcError) -> bool:
    """etcd refused the token: expired, from before a restart, or older than a change to its users."""
    return exc.code() == grpc.StatusCode.UNAUTHENTICATED or "auth" in (exc.details() or "")
