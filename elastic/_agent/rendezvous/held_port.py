"""The port the rendezvous store listens on, taken before anyone else can, or refused in one line.

Under Slurm the job's first node hosts the c10d store on a port every agent
computes from the job id (20000 + id mod 5000: see elastic._shared.slurm.step),
so any local user can predict it and listen there first; torch's store would
then fail to start, and the other nodes' agents would meet at the stranger's.
`HeldPort.take` binds and listens on it at once, on every address (IPv6 and
IPv4); the store later serves on that very socket (`fileno`, torch's
`master_listen_fd`), so there is no moment in which the port is free.

Invariants:
- A port another socket is bound or listening on is refused (`PortTaken`, one
  line naming the holder's uid when /proc/net says it), never shared:
  SO_REUSEADDR only lets the bind through connections of an earlier run
  waiting to close (TIME_WAIT); SO_REUSEPORT, which would share it, is not set.
- What /proc/net/tcp{,6} says is read bounded and parsed defensively: a line
  it cannot read names no holder.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Iterable

PROC_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
MAX_TABLE_BYTES = 32 << 20
_BOUND_STATES = {"0A", "07"}  # LISTEN, and CLOSE: bound without listening
BACKLOG = 1024


class PortTaken(OSError):
    """The port is bound by another socket (one line, who holds it when known)."""


class HeldPort:
    """A listening socket on `port` of every address of this host, held until the store takes it."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock: socket.socket | None = sock
        self.port = sock.getsockname()[1]

    @classmethod
    def take(cls, port: int, *, tables: Iterable[str] = PROC_TABLES, listen: bool = True) -> HeldPort:
        """Bind (and listen on) `port` now; `PortTaken` if another socket holds it."""
        sock = _dual_stack_socket()
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("::" if sock.family == socket.AF_INET6 else "0.0.0.0", port))
            if listen:
                sock.listen(BACKLOG)
        except OSError as exc:
            sock.close()
            if exc.errno != errno.EADDRINUSE:
                raise
            raise PortTaken(_taken_line(port, holder_uid(port, tables))) from None
        return cls(sock)

    def detach(self) -> int:
        """The socket's descriptor, handed over: its new owner (torch's store) closes it."""
        if self._sock is None:
            raise ValueError("the held port was already handed over")
        fd, self._sock = self._sock.detach(), None
        return fd

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _dual_stack_socket() -> socket.socket:
    """An IPv6 socket that also takes IPv4 (so a holder on either family is seen), or IPv4 alone."""
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    except OSError:
        return socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    return sock


def _taken_line(port: int, uid: int | None) -> str:
    if uid is None:
        who = "another process"
    elif uid == os.geteuid():
        who = f"a process of yours (uid {uid}: an agent of an earlier job still running?)"
    else:
        who = f"another user (uid {uid})"
    return (f"port {port} on this node, where this job's rendezvous store must listen, is already taken by {who}: "
            "refusing to start, since the other nodes' agents would meet there instead; "
            "free the port, or give --rdzv-endpoint HOST:PORT with a port of your own")


def holder_uid(port: int, tables: Iterable[str] = PROC_TABLES) -> int | None:
    """The uid of a socket bound to `port` as /proc/net's tables list it (listening first); None if unknown."""
    found: int | None = None
    for table in tables:
        try:
            with open(table, "rb") as f:
                text = f.read(MAX_TABLE_BYTES).decode("ascii", errors="replace")
        except OSError:
            continue
        for line in text.splitlines()[1:]:
            entry = _entry(line)
            if entry is None or entry[0] != port:
                continue
            if entry[1] == "0A":
                return entry[2]
            found = entry[2] if found is None else found
    return found


def _entry(line: str) -> tuple[int, str, int] | None:
    """(local port, state, uid) of one line of /proc/net/tcp{,6}; None if it does not read as one."""
    fields = line.split()
    if len(fields) < 8:
        return None
    _, _, port_hex = fields[1].rpartition(":")
    state, uid = fields[3], fields[7]
    if state not in _BOUND_STATES or not (len(port_hex) == 4 and _is_hex(port_hex) and uid.isdigit() and len(uid) <= 10):
        return None
    return int(port_hex, 16), state, int(uid)


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdefABCDEF" for c in text)
