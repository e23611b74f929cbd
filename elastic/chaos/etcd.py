"""A real etcd member started from this machine's `etcd` binary (Debian:
etcd-server): for chaos runs that need etcd to fail and come back, and for tests.

    server = EtcdServer(Path("/tmp/etcd-data"))   # free ports, v2 API off
    server.start()                                # returns once /health says so
    server.stop(); server.start()                 # a restart on the same data
    server.endpoint                               # "127.0.0.1:PORT" for --rdzv-endpoint

Invariants: a member listens only where it is told (loopback by default; add
a virtual network's gateway to `listen_hosts` to serve its hosts), keeps its data
across `stop()`/`start()`, and `stop()` leaves no process behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from elastic.chaos.netns import free_port
from elastic.errors import UsageError


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

    def etcdctl(self, *args: str, user: str | None = None) -> str:
        """Run etcdctl (v3 API) against this member; returns stdout, raises on failure."""
        command = ["etcdctl", f"--endpoints={self.url}"]
        if self.tls:
            command += [f"--cacert={self.tls.ca}", f"--cert={self.tls.client_cert}", f"--key={self.tls.client_key}"]
        if user:
            command.append(f"--user={user}")
        done = subprocess.run(command + list(args), env={**os.environ, "ETCDCTL_API": "3"}, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout
