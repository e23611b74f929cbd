"""A real etcd member started from this machine's `etcd` binary (Debian:
etcd-server): for chaos runs that need etcd to fail and come back, and for tests.

    server = EtcdServer(Path("/tmp/etcd-data"))   # free ports, v2 API off
    server.start()                                # returns once /health says so
    server.stop(); server.start()                 # a restart on the same data
    server.endpoint                               # "127.0.0.1:PORT" for --rdzv-endpoint
    server.keys("/torchrevive/job1/")             # what etcdctl would show, through gRPC

No etcdctl is needed: listing and writing keys, leases and turning authentication
on go through etcd's gRPC API (the stubs the rendezvous itself uses).

Invariants: a member listens only where it is told (loopback by default; add
a virtual network's gateway to `listen_hosts` to serve its hosts), keeps its data
across `stop()`/`start()`, and `stop()` leaves no process behind.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import requests
from pyetcd import etcdrpc

from elastic._agent.rendezvous.etcd_messages import prefix_end
from elastic._shared.common.errors import UsageError
from elastic.chaos.netns import free_port


@dataclass(frozen=True)
class Tls:
    """TLS files: the CA, etcd's server certificate and key, a client certificate and key."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def etcd_binary() -> str:
    path = shutil.which("etcd")
    if path is None:
        raise UsageError("etcd is not installed (Debian: apt-get install etcd-server), or pass --endpoint of a running one")
    return path


class EtcdServer:
    """One etcd member. `stop()` then `start()` restarts it on the same data."""

    def __init__(self, data_dir: Path, tls: Tls | None = None, listen_hosts: tuple[str, ...] = ("127.0.0.1",)) -> None:
        self.data_dir = data_dir
        self.tls = tls
        self.listen_hosts = listen_hosts
        self.port = free_port()
        self.peer_port = free_port()
        self.log_path = data_dir.with_suffix(".log")
        self._process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        peer = f"http://127.0.0.1:{self.peer_port}"
        command = [
            etcd_binary(),
            "--name", "test",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls",
            ",".join(f"{'https' if self.tls else 'http'}://{host}:{self.port}" for host in self.listen_hosts),
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"test={peer}",
            "--enable-v2=false",
            "--log-level", "warn",
        ]
        if self.tls:
            command += [
                "--cert-file", str(self.tls.server_cert),
                "--key-file", str(self.tls.server_key),
                "--trusted-ca-file", str(self.tls.ca),
                "--client-cert-auth",
            ]
        return command

    def start(self, timeout: float = 30) -> None:
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self.stop()
                raise RuntimeError(f"etcd exited at start: {self.log_path.read_text()[-2000:]}")
            if self.healthy():
                return
            time.sleep(0.1)
        self.stop()  # never leave a member behind that the caller thinks is not running
        raise RuntimeError(f"etcd did not become healthy in {timeout} s: {self.log_path.read_text()[-2000:]}")

    def healthy(self) -> bool:
        kwargs = {}
        if self.tls:
            kwargs = {"verify": str(self.tls.ca), "cert": (str(self.tls.client_cert), str(self.tls.client_key))}
        try:
            return requests.get(f"{self.url}/health", timeout=1, **kwargs).json().get("health") == "true"
        except (requests.RequestException, ValueError):
            return False

    def stop(self) -> None:
        if self._process and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

    def __enter__(self) -> EtcdServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what an operator would do with etcdctl, through etcd's own gRPC API ---------------

    def keys(self, key: str, *, prefix: bool = True, user: tuple[str, str] | None = None) -> list[str]:
        """The keys under `key` (or `key` itself, without `prefix`), sorted; `user` is
        (name, password) once authentication is on."""
        request = etcdrpc.RangeRequest(key=key.encode(), range_end=prefix_end(key.encode()) if prefix else b"", keys_only=True)
        reply = self._rpc(lambda s, meta: s.kv.Range(request, timeout=_RPC_SECONDS, metadata=meta), user)
        return sorted(kv.key.decode() for kv in reply.kvs)

    def value(self, key: str) -> str | None:
        """The value of `key` (None when it does not exist)."""
        request = etcdrpc.RangeRequest(key=key.encode())
        reply = self._rpc(lambda s, meta: s.kv.Range(request, timeout=_RPC_SECONDS, metadata=meta))
        return reply.kvs[0].value.decode() if reply.kvs else None

    def put(self, key: str, value: str) -> None:
        request = etcdrpc.PutRequest(key=key.encode(), value=value.encode())
        self._rpc(lambda s, meta: s.kv.Put(request, timeout=_RPC_SECONDS, metadata=meta))

    def lease_ttl(self, lease_id: int) -> int:
        """The TTL lease `lease_id` was granted with (-1 once it is gone)."""
        request = etcdrpc.LeaseTimeToLiveRequest(ID=lease_id)
        return int(self._rpc(lambda s, meta: s.lease.LeaseTimeToLive(request, timeout=_RPC_SECONDS, metadata=meta)).grantedTTL)

    def revoke_lease(self, lease_id: int) -> None:
        """Revoke a lease: every key attached to it goes at once."""
        request = etcdrpc.LeaseRevokeRequest(ID=lease_id)
        self._rpc(lambda s, meta: s.lease.LeaseRevoke(request, timeout=_RPC_SECONDS, metadata=meta))

    def enable_auth(self, root_password: str) -> None:
        """Add user root (role root) with `root_password` and turn authentication on, as
        `etcdctl user add root` and `etcdctl auth enable` do."""
        def admin(stubs: _Stubs, meta: _Metadata) -> None:
            stubs.auth.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password=root_password), timeout=_RPC_SECONDS)
            stubs.auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name="root"), timeout=_RPC_SECONDS)
            stubs.auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=_RPC_SECONDS)
            stubs.auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=_RPC_SECONDS)

        self._rpc(admin)

    def _rpc(self, call: Callable[[_Stubs, _Metadata], T], user: tuple[str, str] | None = None) -> T:
        """`call` on a channel of its own to this member (TLS and a login as `user` when given)."""
        target = f"127.0.0.1:{self.port}"
        if self.tls:
            credentials = grpc.ssl_channel_credentials(
                self.tls.ca.read_bytes(), self.tls.client_key.read_bytes(), self.tls.client_cert.read_bytes()
            )
            channel = grpc.secure_channel(target, credentials)
        else:
            channel = grpc.insecure_channel(target)
        with channel:
            stubs = _Stubs(etcdrpc.KVStub(channel), etcdrpc.LeaseStub(channel), etcdrpc.AuthStub(channel))
            meta: _Metadata = None
            if user is not None:
                login = etcdrpc.AuthenticateRequest(name=user[0], password=user[1])
                meta = (("token", stubs.auth.Authenticate(login, timeout=_RPC_SECONDS).token),)
            return call(stubs, meta)


_RPC_SECONDS = 30
_Metadata = tuple[tuple[str, str], ...] | None
T = TypeVar("T")


@dataclass(frozen=True)
class _Stubs:
    kv: Any
    lease: Any
    auth: Any
