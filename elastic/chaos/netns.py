"""Several hosts on one machine: network namespaces on a virtual switch.

    with VirtualNetwork.create() as net:
        address = net.add_host()                # 10.X.Y.1, in namespace net.namespace(0)
        command = net.wrap(0, ["python", ...])  # runs inside that host
        net.cut(0); net.heal(0)                 # pull the host's cable, plug it back

Each host is a namespace with one interface, `eth0`, cabled to a bridge that
lives in a namespace of its own (the switch), so no firewall rule of this
machine's own namespace sees the traffic between hosts. This machine joins the
switch too, at `gateway` (10.X.Y.254): a server started here on that address
(or on 0.0.0.0), an etcd say, is reachable from every host. `cut` takes a
host's switch port down: its connections stall without a reset, exactly as
when a cable or a top-of-rack switch fails.

Invariants: needs root and iproute2's `ip`; every namespace and link it made,
and every process still running inside one, is gone after `close()` (deleting
the switch namespace deletes the cables). Names carry the creating process's
pid and a random id, so several networks can exist at once, and `create()`
first removes what a creator that died without `close()` left behind. The
/24 is one this machine does not use yet.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import uuid
from pathlib import Path

from elastic._shared.common.errors import ElasticError
from elastic._shared.slurm.step import RENDEZVOUS_PORT_BASE

INTERFACE = "eth0"
"""The host side of every cable; point GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME at it."""


class NetworkUnavailable(ElasticError):
    """Network namespaces cannot be made here (not root, no `ip`, no kernel support)."""

    exit_code = 2


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_pick = random.SystemRandom()  # not the seedable module-level generator: a test's seed must not repeat ports


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now, below the kernel's ephemeral range and below the ports the
    runtime picks itself, where it can.

    A port in the ephemeral range (the kernel's own pick for `bind(0)`) can be taken by any outgoing
    connection, a peer's, a store client's, before the server meant to listen there binds it. Above
    `RENDEZVOUS_PORT_BASE` the runtime picks ports of its own (Slurm stores from 20000, each round's
    worker store from 25000: elastic._agent.rendezvous.worker_port) and holds them bound until their
    server starts: a job beside this one could take the port this one's rendezvous was given, and
    every agent would then wait for a server nobody listens for (a full suite saw it). Below it, only
    another pick of this function can take it."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    top = min(low, RENDEZVOUS_PORT_BASE) if low // 2 + 1024 <= RENDEZVOUS_PORT_BASE else low
    for _ in range(100 if low > 4096 else 0):
        port = _pick.randrange(low // 2, top)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise NetworkUnavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


_NAME = re.compile(r"^trv-(?P<pid>\d+)-[0-9a-f]+-(sw|h\d+)\b", re.M)


def _delete_namespace(name: str) -> None:
    """Kill what still runs inside `name`, then delete it."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def sweep_abandoned() -> list[str]:
    """Delete the namespaces of networks whose creating process is gone; their names."""
    abandoned = [
        m.group(0) for m in _NAME.finditer(_ip("netns", "list")) if not os.path.exists(f"/proc/{m.group('pid')}")
    ]
    for name in abandoned:
        _delete_namespace(name)
    return abandoned


def _unused_prefix() -> str:
    """A 10.X.Y /24 that no address or route of this machine touches."""
    taken = _ip("-4", "addr") + _ip("-4", "route")
    for _ in range(1000):
        prefix = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
        if f"{prefix}." not in taken:
            return prefix
    raise NetworkUnavailable("no free 10.200-250.x.0/24 for a virtual network")


class VirtualNetwork:
    """Hosts (network namespaces) on one switch, plus this machine at `gateway`."""

    def __init__(self, prefix: str) -> None:
        self.id = uuid.uuid4().hex[:6]
        self.prefix = prefix
        """The /24 every address is in, as 'A.B.C'."""
        self.gateway = f"{prefix}.254"
        self._names = f"trv-{os.getpid()}-{self.id}"
        self._switch = f"{self._names}-sw"
        self._root_link = f"trv{self.id}"
        self._hosts: list[str] = []

    @classmethod
    def create(cls, prefix: str | None = None) -> VirtualNetwork:
        """A switch with this machine on it; raises `NetworkUnavailable` with the reason."""
        if shutil.which("ip") is None:
            raise NetworkUnavailable("iproute2's `ip` is not installed (Debian: apt-get install iproute2)")
        if os.geteuid() != 0:
            raise NetworkUnavailable("network namespaces need root")
        sweep_abandoned()
        net = cls(prefix or _unused_prefix())
        try:
            _ip("netns", "add", net._switch)
            _ip("-n", net._switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", net._switch, "link", "set", "br0", "up")
            _ip("link", "add", net._root_link, "type", "veth", "peer", "name", "gw", "netns", net._switch)
            _ip("-n", net._switch, "link", "set", "gw", "master", "br0", "up")
            _ip("addr", "add", f"{net.gateway}/24", "dev", net._root_link)
            _ip("link", "set", net._root_link, "up")
        except NetworkUnavailable:
            net.close()
            raise
        return net

    @property
    def hosts(self) -> int:
        return len(self._hosts)

    def address(self, host: int) -> str:
        return f"{self.prefix}.{host + 1}"

    def namespace(self, host: int) -> str:
        return self._hosts[host]

    def add_host(self) -> str:
        """One more host on the switch; returns its address."""
        index = len(self._hosts)
        if index >= 250:
            raise ValueError("a virtual network holds at most 250 hosts")
        name = f"{self._names}-h{index}"
        port = f"h{index}"
        _ip("netns", "add", name)
        self._hosts.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", name, "link", "add", INTERFACE, "type", "veth", "peer", "name", port, "netns", self._switch)
        _ip("-n", self._switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", name, "addr", "add", f"{self.address(index)}/24", "dev", INTERFACE)
        _ip("-n", name, "link", "set", INTERFACE, "up")
        return self.address(index)

    def wrap(self, host: int, command: list[str]) -> list[str]:
        """`command` run inside `host` (`ip netns exec` execs it: same process)."""
        return ["ip", "netns", "exec", self.namespace(host), *command]

    def cut(self, host: int) -> None:
        """Unplug `host`: packets to and from it are dropped, connections stall."""
        _ip("-n", self._switch, "link", "set", f"h{host}", "down")

    def heal(self, host: int) -> None:
        _ip("-n", self._switch, "link", "set", f"h{host}", "up")

    def close(self) -> None:
        """Kill what runs inside, delete every namespace (and with the switch, every
        cable); safe to repeat."""
        for name in [*self._hosts, self._switch]:
            _delete_namespace(name)
        self._hosts.clear()

    def __enter__(self) -> VirtualNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
