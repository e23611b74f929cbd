"""The rendezvous state in a c10d store, as torch's `C10dRendezvousBackend` keeps it, through a `StateGuard`.

`C10dStateBackend` keeps torch's layout (its sentinel, base64, the stored value as the token) at the
key the guard names (`StateSeal.store_key`: torch's own `torch.rendezvous.<run id>` when unsigned, a
key the secret names when signed), so a value written there the way torch would is read exactly as
torch would read it, and then refused by the guard; a value that is not even base64 is refused the
same way (torch would raise and end the agent). The `c10d-sealed` handler
(handlers.create_c10d_sealed) keeps its state here.

Invariant: torch receives only what the guard admitted (state_guard), and the store's
compare-and-set, on the sealed bytes, decides who wins a write.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from torch.distributed import Store
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elastic._agent.rendezvous.state_guard import StateGuard

SENTINEL = b"Y2FuaW1hZGFt"
"""torch's `C10dRendezvousBackend._NULL_SENTINEL`: the key's value before the first state."""


class C10dStateBackend(RendezvousBackend):
    """The rendezvous state in a c10d store, as torch's `C10dRendezvousBackend` keeps it, through `guard`."""

    def __init__(self, store: Store, run_id: str, guard: StateGuard, *, name: str = "c10d") -> None:
        self._store = store
        if guard.run_id != run_id:
            raise ValueError(f"the guard is run {guard.run_id!r}'s, not {run_id!r}'s")
        self.guard = guard
        self.key = guard.store_key
        """Where the state lies in `store`."""
        self._name = name
        self._call("compare_set", self.key, "", SENTINEL)  # as torch: a read of a missing key would block

    @property
    def name(self) -> str:
        """The backend's name, which torch's registry checks against `--rdzv-backend`."""
        return self._name

    def get_state(self) -> tuple[bytes, Token] | None:
        return self._decoded(self._call("get", self.key))

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        if token and not isinstance(token, bytes):  # not a token of this backend's: it cannot match
            current = self.get_state()
            return None if current is None else (*current, False)
        blob, seq = self.guard.sealed(state)
        encoded = base64.b64encode(blob)
        current = self._call("compare_set", self.key, token or SENTINEL, encoded)
        if current == encoded:
            self.guard.won(state, seq, blob)
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
