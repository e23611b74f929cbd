"""torchrevive-run's rendezvous handlers: torch's, with the state guarded, and the Slurm host's port held.

`install(key)` makes torch's launcher (in this process) get every rendezvous
handler here:

- `c10d`: torch's own c10d store (`torch...c10d_rendezvous_backend.create_backend`),
  or, where `hold` took the store's port first (the Slurm job's first node),
  a store serving on that held socket; the state through `C10dStateBackend`;
- any other backend of torch's dynamic rendezvous (`etcd-v2`, a plug-in): its
  backend wrapped in `state_guard.GuardedBackend`;
- `etcd-v3` guards its state itself (`etcd.create_backend`), under plain torchrun too.

Invariants:
- No torch dynamic handler leaves here with an unguarded backend: one this
  cannot guard ends the agent with one line and exit 2.
- `C10dStateBackend` keeps torch's layout (the key `torch.rendezvous.<run id>`,
  its sentinel, base64, the stored value as the token), so a value a stranger
  writes there the way torch would is read exactly as torch would read it,
  and then refused by the guard; a value that is not even base64 is refused the
  same way (torch would raise and end the agent).
"""

from __future__ import annotations

import base64
import binascii
import sys
from datetime import timedelta
from typing import Any

from torch.distributed import Store, TCPStore
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    Token,
    create_handler,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from elastic._agent.rendezvous import store_liveness
from elastic._agent.rendezvous.held_port import HeldPort
from elastic._agent.rendezvous.state_guard import GuardedBackend, StateGuard
from elastic._shared.storage.peer_auth import PeerKey

SENTINEL = b"Y2FuaW1hZGFt"
"""torch's `C10dRendezvousBackend._NULL_SENTINEL`: the key's value before the first state."""
DEFAULT_PORT = 29400
_held: dict[int, HeldPort] = {}
_key: PeerKey | None = None
_installed = False


class C10dStateBackend(RendezvousBackend):
    """The rendezvous state in a c10d store, as torch's `C10dRendezvousBackend` keeps it, through `guard`."""

    def __init__(self, store: Store, run_id: str, guard: StateGuard) -> None:
        self._store = store
        self._key = "torch.rendezvous." + run_id
        self.guard = guard
        self._call("compare_set", self._key, "", SENTINEL)  # as torch: a read of a missing key would block

    @property
    def name(self) -> str:
        return "c10d"

    def get_state(self) -> tuple[bytes, Token] | None:
        return self._decoded(self._call("get", self._key))

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        if token and not isinstance(token, bytes):  # not a token of this backend's: it cannot match
            current = self.get_state()
            return None if current is None else (*current, False)
        blob, seq = self.guard.sealed(state)
        encoded = base64.b64encode(blob)
        current = self._call("compare_set", self._key, token or SENTINEL, encoded)
        if current == encoded:
            self.guard.won(state, seq)
            return state, current, True
        decoded = self._decoded(current)
        return None if decoded is None else (*decoded, False)

    def _decoded(self, value: bytes) -> tuple[bytes, Token] | None:
        if value == SENTINEL:
            return None
        try:
            blob = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            blob = b""  # refused by the guard like any other value that is not a state
        return self.guard.admit(blob), value

    def _call(self, operation: str, *args: Any) -> Any:
        try:
            return getattr(self._store, operation)(*args)
        except (ValueError, RuntimeError, TimeoutError) as exc:
            raise RendezvousConnectionError(f"the c10d rendezvous store failed: {exc}".splitlines()[0]) from exc


def hold(port: int) -> None:
    """Take `port` for the c10d store this agent will host (`held_port.PortTaken` if another socket holds it)."""
    if port not in _held:
        _held[port] = HeldPort.take(port)


def create_c10d_handler(params: RendezvousParameters, key: PeerKey | None) -> DynamicRendezvousHandler:
    """torch's c10d handler, its state through `C10dStateBackend`, its store on a held port when there is one."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        create_backend,
    )

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    held = _held.pop(port, None)
    if held is not None and params.get_as_bool("is_host", True) and params.get("store_type", "tcp") == "tcp":
        timeout = timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
        store: Store = TCPStore(host, port, is_master=True, multi_tenant=True, timeout=timeout,
                                master_listen_fd=held.detach())
    else:
        if held is not None:
            held.close()
        _, store = create_backend(params)
    backend = C10dStateBackend(store, params.run_id, StateGuard.for_run(params.run_id, key))
    handler = create_handler(store, backend, params)
    store_liveness.key_heartbeats(handler, store, params.run_id, key)  # a key per node, not the state rewritten
    return handler


def guard_handler(handler: Any, params: RendezvousParameters, key: PeerKey | None) -> Any:
    """`handler` with its state guarded, when it is torch's dynamic rendezvous (others hold no pickle)."""
    if not isinstance(handler, DynamicRendezvousHandler):
        return handler
    holder = getattr(handler, "_state_holder", None)
    backend = getattr(holder, "_backend", None)
    if not isinstance(backend, RendezvousBackend):
        print("torchrevive-run: error: this torch's rendezvous handler keeps its state where torchrevive-run cannot "
              "check it before torch unpickles it; use the torch this release was tested with", file=sys.stderr,
              flush=True)
        raise SystemExit(2)
    if not getattr(backend, "guard", None):
        holder._backend = GuardedBackend(backend, StateGuard.for_run(params.run_id, key))
    return handler


def install(key: PeerKey | None) -> None:
    """Make torch's launcher (in this process) get its rendezvous handlers here (see the module
    docstring), states signed with `key` when given. Before `quick_rounds.install`, which wraps
    whatever this leaves. Once per process; a later call only changes the key."""
    from torch.distributed.elastic.rendezvous import registry

    global _key, _installed
    _key = key
    if _installed:  # (quick rounds' wrapper is outside this one by then: wrapping again would skip it)
        return
    original = registry.get_rendezvous_handler

    def get_rendezvous_handler(params: RendezvousParameters) -> Any:
        if params.backend == "c10d":
            return create_c10d_handler(params, _key)
        return guard_handler(original(params), params, _key)

    registry.get_rendezvous_handler = get_rendezvous_handler
    _installed = True
