"""The port of each round's worker store: one the kernel hands to no other socket meanwhile.

With a fresh worker store per round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which
torchrevive-run sets), torch's rank-0 agent picks the port the rank-0 worker's
store will listen on with `get_free_port`: it binds port 0, reads the port the
kernel chose and closes it; the worker binds it a moment later, after its start.
The kernel hands ports of the ephemeral range (`ip_local_port_range`) to every
bind to port 0 and every connect on the host (gloo alone makes dozens of
listeners per group), so in between another socket may be given that very port,
and the round fails with EADDRINUSE (seen in the test suite on a loaded machine).

`pick` chooses a free port *below* the ephemeral range instead, which the kernel
never hands out by itself: only a program that names that port can take it in
between. It starts above the ports our own Slurm stores use (20000 + job id mod
5000: elastic._shared.slurm.step).

Invariants:
- The port returned was free (a bind succeeded) when chosen, and lies in
  [`LOW`, the ephemeral range's start), unless no such port could be bound in
  `ATTEMPTS` tries (or the range starts at or below `LOW`); then it is torch's own choice.
- What /proc says is read bounded and parsed defensively: anything odd means
  torch's default range start (32768).
"""

from __future__ import annotations

import random
import socket
from collections.abc import Callable

PORT_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
DEFAULT_EPHEMERAL_START = 32768
LOW = 25000
"""The lowest port picked: above the common services' ports and our Slurm stores' (20000-24999)."""
ATTEMPTS = 32


def ephemeral_start(path: str = PORT_RANGE_FILE) -> int:
    """The first port of the kernel's ephemeral range (DEFAULT_EPHEMERAL_START when unreadable)."""
    try:
        with open(path, encoding="ascii") as f:
            low, _high = (int(part) for part in f.read(64).split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_START
    return low if 1024 < low <= 65535 else DEFAULT_EPHEMERAL_START


def bindable(port: int) -> bool:
    """Whether a TCP socket can bind `port` on every address now (closed again at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def pick(
    fallback: Callable[[], int], *, start: int | None = None, free: Callable[[int], bool] | None = None,
    rng: random.Random | None = None,
) -> int:
    """A free port below the ephemeral range (see the module docstring); `fallback()` when none is."""
    top = ephemeral_start() if start is None else start
    free = free or bindable
    draw = rng or random.SystemRandom()
    for _ in range(ATTEMPTS if top > LOW else 0):
        port = draw.randrange(LOW, top)
        if free(port):
            return port
    return fallback()


def install() -> None:
    """Make torch's rendezvous (in this agent) pick worker store ports with `pick`. Idempotent.

    A patch of a torch module's attribute, one of the few left (docs/architecture.md lists them): torch's
    `DynamicRendezvousHandler.next_rendezvous` calls `get_free_port` through `RendezvousStoreInfo.build`
    after the join, and publishes the port to the other nodes in that same call, so no method of a
    handler or an agent subclass sees the port before the other nodes read it."""
    from torch.distributed.elastic.rendezvous import api

    original = api.get_free_port
    if getattr(original, "below_ephemeral", False):
        return

    def get_free_port() -> int:
        return pick(original)

    get_free_port.below_ephemeral = True  # type: ignore[attr-defined]
    api.get_free_port = get_free_port
