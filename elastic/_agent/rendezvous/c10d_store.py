"""The TCPStore of a `c10d-sealed` rendezvous: torch's store, listening where the endpoint says.

torch's c10d backend (`c10d_rendezvous_backend._create_tcp_store`) starts the store's server on every
address of the host, whatever address the endpoint names: the README's one-host job, whose endpoint
is 127.0.0.1, was reachable from the whole network. Here the agent that hosts the store binds the
listening socket itself and hands it to torch's store (`master_listen_fd`):

- an IP address (`127.0.0.1:29400`, `10.0.0.5:29400`, `[::1]:29400`) or `localhost`: that address only;
- a host name: every address, as torch does (a name may resolve to 127.0.1.1 on its own host and to
  the real address on the others, so binding what it resolves to here could shut the others out);
- a port taken before anything else of the job started (`hold`: the Slurm job's first node, whose
  port anyone can compute): that very socket, so there is no moment in which the port is free.

Which agent hosts: `is_host` of `--rdzv-conf` when given; else torch's guess (the endpoint names this
machine), and a guess that finds the port taken (another agent of this host hosts it) or the address
not this machine's makes this agent a client, as torch does. An explicit `is_host=1` that cannot bind
is `RendezvousConnectionError`, as torch raises it.

Invariants: the store never listens on an address the endpoint does not name, except for a host
name; a held port is used at most once (`hold` again to take it again).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import socket
from datetime import timedelta

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.utils import (
    _matches_machine_hostname,
    parse_rendezvous_endpoint,
)

from elastic._agent.rendezvous.held_port import BACKLOG, HeldPort

DEFAULT_PORT = 29400
"""torch's c10d default."""
_held: dict[int, HeldPort] = {}


def hold(port: int) -> None:
    """Take `port` for the c10d store this agent will host (`held_port.PortTaken` if another socket holds it)."""
    if port not in _held:
        _held[port] = HeldPort.take(port)


def read_timeout(params: RendezvousParameters) -> timedelta:
    seconds = params.get_as_int("read_timeout", 60)
    if seconds is None or seconds <= 0:
        raise ValueError("The read timeout must be a positive integer.")  # torch's words
    return timedelta(seconds=seconds)


def bind_address(host: str) -> tuple[socket.AddressFamily, str]:
    """The family and address the store of an endpoint on `host` listens on ("" with AF_INET6: every
    address, IPv4 too)."""
    if host.lower() == "localhost":
        return socket.AF_INET, "127.0.0.1"
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return socket.AF_INET6, ""
    return (socket.AF_INET6 if address.version == 6 else socket.AF_INET), str(address)


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on `port` of the endpoint's address (`bind_address`); OSError if it cannot."""
    family, address = bind_address(host)
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        if address:
            raise
        family, sock = socket.AF_INET, socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past an earlier run's TIME_WAIT only
        if family == socket.AF_INET6 and not address:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((address or ("::" if family == socket.AF_INET6 else "0.0.0.0"), port))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def create_store(params: RendezvousParameters) -> TCPStore:
    """The rendezvous store for `params` (see the module docstring): served here, or a client of it."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    timeout = read_timeout(params)
    told = params.get_as_bool("is_host")
    held = _held.pop(port, None)
    if held is not None:
        if told is not False:
            return _serve(host, held.port, held.detach(), timeout)
        held.close()
    if told if told is not None else _matches_machine_hostname(host):
        try:
            sock = listening_socket(host, port)
        except OSError as exc:
            if told is not None or exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                raise RendezvousConnectionError(
                    f"cannot serve the c10d rendezvous store on {host}:{port}: {exc.strerror or exc}") from None
        else:
            return _serve(host, sock.getsockname()[1], sock.detach(), timeout)
    try:
        return TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timeout)
    except (ValueError, RuntimeError, TimeoutError) as exc:
        raise RendezvousConnectionError(
            "The connection to the C10d store has failed. See inner exception for details.") from exc


def _serve(host: str, port: int, fd: int, timeout: timedelta) -> TCPStore:
    try:
        return TCPStore(host, port, is_master=True, multi_tenant=True, timeout=timeout, master_listen_fd=fd)
    except (ValueError, RuntimeError, TimeoutError) as exc:
        raise RendezvousConnectionError(
            "The connection to the C10d store has failed. See inner exception for details.") from exc
