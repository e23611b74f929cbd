"""The rendezvous state between torch and the store: sealed on the way in, checked on the way out.

torch's dynamic rendezvous reads and writes its pickled state through a backend's
`get_state`/`set_state` and unpickles whatever `get_state` returns. `StateGuard`
stands on that path for one agent: what torch writes is sealed
(`state_seal.StateSeal`: signed with the job's secret when it has one), and what
the store holds is handed to torch only once `StateSeal.open` verified it and
`state_pickle.check_state` read it without running anything.

A state refused (forged, unsigned in a signed job, replayed, malformed, too big)
is never unpickled by torch: the agent prints one warning line per reason and
goes on as if the store still held the last state it verified (a fresh state
if it has none), with the refused value's token. That is what torch's retry
logic already does when another agent wrote first: its next write, a
compare-and-set against that token, replaces the refused value, so a job whose
store was written by a stranger trains on.

Invariants:
- torch receives only bytes that passed `StateSeal.open` (or its own last
  verified or written state, or a fresh one this module pickled).
- With a secret, a state whose write number is below one this agent already
  verified or wrote is refused: a recorded state written back later (a replay)
  cannot take the run back.
- `GuardedBackend` changes neither tokens nor who wins a write: the store's
  compare-and-set decides, on the sealed bytes.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
from collections.abc import Callable, Mapping

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    Token,
    _RendezvousState,
)

from elastic._agent.rendezvous.state_pickle import StateRefused
from elastic._agent.rendezvous.state_seal import StateSeal
from elastic._shared.storage.peer_auth import PeerKey


def _warn(line: str) -> None:
    print(f"torchrevive: warning: {line}", file=sys.stderr, flush=True)


class StateGuard:
    """One agent's seal and memory of the run's state (thread-safe: torch's keep-alive timer syncs too)."""

    def __init__(self, seal: StateSeal, warn: Callable[[str], None] = _warn) -> None:
        self._seal = seal
        self._warn = warn
        self._lock = threading.Lock()
        self._seq = 0
        self._last: bytes | None = None
        self._warned: set[str] = set()
        self.refused = 0
        """States refused so far (for tests and reports)."""

    @classmethod
    def for_run(cls, run_id: str, key: PeerKey | None) -> StateGuard:
        return cls(StateSeal(run_id, key))

    @property
    def signed(self) -> bool:
        return self._seal.signed

    def sealed(self, payload: bytes) -> tuple[bytes, int]:
        """What to store for torch's `payload`, and its write number (one more than the last seen)."""
        with self._lock:
            seq = self._seq + 1
        return self._seal.seal(payload, seq), seq

    def won(self, payload: bytes, seq: int) -> None:
        """The store took `payload`, written as number `seq`."""
        with self._lock:
            self._seq = max(self._seq, seq)
            self._last = payload

    def admit(self, blob: bytes) -> bytes:
        """The pickle torch may load for the stored `blob`: its own when it verified, else the last
        state this agent verified or wrote (fresh if none), with one warning per reason."""
        try:
            seq, payload = self._seal.open(blob)
            with self._lock:
                if self._seal.signed and seq < self._seq:
                    raise StateRefused(f"it is write {seq} of the run, older than write {self._seq} this agent "
                                       "has seen (a recorded state written back)")
                self._seq, self._last = max(self._seq, seq), payload
            return payload
        except StateRefused as why:
            with self._lock:
                self.refused += 1
                first = str(why) not in self._warned
                self._warned.add(str(why))
                last = self._last
            if first:
                self._warn(f"the rendezvous state of run {self._seal.run_id} in the store was refused and never "
                           f"unpickled: {why}; this agent goes on from the last state it verified")
            return last if last is not None else pickle.dumps(_RendezvousState())


class GuardedBackend(RendezvousBackend):
    """Any torch rendezvous backend, with `guard` on the state's way in and out."""

    def __init__(self, inner: RendezvousBackend, guard: StateGuard) -> None:
        self.inner = inner
        self.guard = guard

    @property
    def name(self) -> str:
        return self.inner.name

    def get_state(self) -> tuple[bytes, Token] | None:
        got = self.inner.get_state()
        return None if got is None else (self.guard.admit(got[0]), got[1])

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        blob, seq = self.guard.sealed(state)
        got = self.inner.set_state(blob, token)
        if got is None:
            return None
        current, new_token, won = got
        if won:
            self.guard.won(state, seq)
            return state, new_token, True
        return self.guard.admit(current), new_token, False


def job_key(environ: Mapping[str, str] | None = None) -> PeerKey | None:
    """The job's secret the environment names (TORCHREVIVE_SNAPSHOT_SECRET_FILE, else
    TORCHREVIVE_SNAPSHOT_SECRET), or None; `peer_auth.SecretError` when it names one that cannot be read.

    Only a secret given to every agent signs the state: a secret made on one host would differ
    from the next host's, and their agents would refuse each other's states forever."""
    return PeerKey.from_env(os.environ if environ is None else environ)
