"""The rendezvous state between torch and the store: sealed on the way in, checked on the way out.

torch's dynamic rendezvous reads and writes its pickled state through a backend's
`get_state`/`set_state` and unpickles whatever `get_state` returns. `StateGuard`
stands on that path for one agent: what torch writes is sealed
(`state_seal.StateSeal`: signed with the job's secret when it has one), and what
the store holds is handed to torch only once `StateSeal.open` verified it and
`state_pickle.check_state` read it without running anything.

With a secret every state names its launch (`state_seal`). Until its first round
completes an agent's launch is tentative: it writes under a launch id it drew at
random (the first state of a new launch) or under the launch of the state it last
verified, and it takes the launch of any state it verifies that is live (a node's
heartbeat younger than torch's dead-node time, `keep_alive_interval *
keep_alive_max_attempt`, in the state or, where nodes beat in keys of their own
(liveness), in a node's key sealed in that launch's scope (`heard_from`); closed or not: an agent that meets its own launch closed
ends with it, as torch's do). So the agents of a launch agree on it however a
stranger's writes interleave with theirs, and a state left by an earlier launch of
the same run id and secret, or recorded from it, is never taken: nothing of that
launch is accepted by this one. (A state recorded within that time of its launch's
last heartbeat, written into a launch starting within it, is the one exception.)
When its first round completes the handler fixes the agent's launch (`fix`): from
then on a state of another launch is refused.

A state refused (forged, unsigned in a signed job, replayed, of another launch,
malformed, too big) is never unpickled by torch: the agent prints one warning line per
reason and goes on as if the store held the latest state of its launch it can have: the launch's
shadow copy (state_shadow: every won write is copied to a key only the launch's agents can name)
when that is newer than its memory, else the last state it verified or wrote (a fresh state if it
has none), with the refused value's token. That is what torch's retry logic already does when
another agent wrote first: its next write, a compare-and-set against that token, replaces the
refused value (the handler's holder makes that write at its next look: handlers.GuardedStateHolder),
so a job whose store was written by a stranger trains on, and, from the shadow, without undoing
another agent's last write.

Invariants:
- torch receives only bytes that passed `StateSeal.open` (or its own last
  verified or written state, or a fresh one this module pickled).
- With a secret, a state whose write number is below one this agent already
  verified or wrote in its launch is refused: a recorded state written back
  later (a replay) cannot take the run back.
- With a secret, the first write after a refused read that the shadow could not
  bring up to date is numbered `AFTER_REFUSAL` past the last write this agent
  saw: it was built on an older state than another agent may hold, and a number
  that agent's replay check would refuse would leave the two waiting on each
  other's copies for good. The other agent takes it instead (its own last write
  undone); a round that leaves in a copy nobody can share is joined again
  (handlers.unsound_round).
- With a secret, `launch` never changes once fixed; the tentative one changes only
  to the launch of a state that verified and was live.
- A backend using a guard (guarded_c10d, etcd) changes neither tokens nor who
  wins a write: the store's compare-and-set decides, on the sealed bytes.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

from elastic._agent.rendezvous.state_pickle import StateRefused
from elastic._agent.rendezvous.state_seal import Opened, StateSeal
from elastic._agent.rendezvous.state_shadow import StateShadow
from elastic._agent.timings import DEFAULT_LIVE_WITHIN
from elastic._shared.protocol.round_identity import new_launch
from elastic._shared.storage.peer_auth import PeerKey

logger = logging.getLogger(__name__)

AFTER_REFUSAL = 1 << 20
"""How far past the last write seen the first write after an unrecovered refusal is numbered (see above)."""


def _warn(line: str) -> None:
    print(f"torchrevive: warning: {line}", file=sys.stderr, flush=True)


class StateGuard:
    """One agent's seal and memory of the run's state (thread-safe: torch's keep-alive timer syncs too)."""

    def __init__(
        self, seal: StateSeal, warn: Callable[[str], None] = _warn, *, live_within: float = DEFAULT_LIVE_WITHIN,
        clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
    ) -> None:
        """`live_within`: seconds within which a node of a state this agent meets first must have sent a
        heartbeat (torch's dead-node time); `clock`: the time heartbeats are compared with."""
        self._seal = seal
        self._warn = warn
        self.live_within = live_within
        """Seconds (torch's dead-node time: the handler sets it from its settings)."""
        self.heard_from: Callable[[str, list[Any]], list[datetime]] | None = None
        """The beats, sealed in a launch's scope, of a state's nodes (liveness.Heartbeats.heard_from): their
        heartbeats are in keys of their own, and the state's record of them ages while a job trains."""
        self.check_launch = True
        self.shadow: StateShadow | None = None
        """Where won writes are copied and refused reads recover from (state_shadow); None: nowhere."""
        """False for a guard that only reads a state to look at it (etcd-v3's check for a closed run)."""
        self._clock = clock
        self._lock = threading.Lock()
        self._seq = 0
        self._last: bytes | None = None
        self._current = new_launch()
        """The launch this agent writes under: its draft, or the last one it verified (tentative), or `launch`."""
        self.launch: str | None = None
        """This agent's launch, once fixed (see the module docstring); None before, and without a secret."""
        self._stale = False
        """A refused read went on from this agent's own copy, which may be older than another agent's."""
        self._warned: set[str] = set()
        self.refused = 0
        """States refused so far (for tests and reports)."""

    @classmethod
    def for_run(cls, run_id: str, key: PeerKey | None, *, live_within: float = DEFAULT_LIVE_WITHIN) -> StateGuard:
        return cls(StateSeal(run_id, key), live_within=live_within)

    @property
    def signed(self) -> bool:
        return self._seal.signed

    @property
    def run_id(self) -> str:
        return self._seal.run_id

    @property
    def store_key(self) -> str:
        """The c10d store key the run's state lies at (`StateSeal.store_key`)."""
        return self._seal.store_key()

    def sealed(self, payload: bytes) -> tuple[bytes, int]:
        """What to store for torch's `payload`, and its write number (one more than the last seen)."""
        with self._lock:
            seq, launch = self._seq + (AFTER_REFUSAL if self._stale else 1), self._current
        return self._seal.seal(payload, seq, launch), seq

    def won(self, payload: bytes, seq: int, blob: bytes | None = None) -> None:
        """The store took `payload`, written as number `seq` (sealed as `blob`: copied to the shadow)."""
        with self._lock:
            self._seq = max(self._seq, seq)
            self._last = payload
            self._stale = False
            launch = self._current
        if blob is not None and self.shadow is not None and self._seal.signed:
            self.shadow.write(self._seal.shadow_key(launch), blob)  # (a store write: never with the lock held)

    @property
    def current_launch(self) -> str | None:
        """The launch this agent writes and reads the round's store under: its fixed one, else the tentative
        one (the launch of the round that just completed, while torch's handler finishes the round); None
        without a secret."""
        with self._lock:
            return None if not self._seal.signed else self.launch or self._current

    def fix(self) -> None:
        """This agent's first round completed: its launch is the one it writes under now (signed jobs)."""
        with self._lock:
            if self._seal.signed and self.launch is None:
                self.launch = self._current

    def admit(self, blob: bytes) -> bytes:
        """The pickle torch may load for the stored `blob`: its own when it verified, else the last
        state this agent verified or wrote (fresh if none), with one warning per reason."""
        try:
            opened = self._seal.open(blob)
            heard = self._heard(opened)  # (a store read: never with the lock held, which torch's timer needs)
            with self._lock:
                if self._seal.signed and self.check_launch:
                    self._check_launch(opened, heard)
                self._seq, self._last, self._stale = max(self._seq, opened.seq), opened.payload, False
            return opened.payload
        except StateRefused as why:
            with self._lock:
                self.refused += 1
                first = str(why) not in self._warned
                self._warned.add(str(why))
            if first:
                self._warn(f"the rendezvous state of run {self._seal.run_id} in the store was refused and never "
                           f"unpickled: {why}; this agent goes on from the latest state of its launch it has")
            recovered = self._from_shadow()
            if recovered is not None:
                return recovered
            with self._lock:
                last, self._stale = self._last, self._seal.signed
            return last if last is not None else pickle.dumps(_RendezvousState())

    def _from_shadow(self) -> bytes | None:
        """The payload of the launch's shadow copy when it verifies and is newer than this agent's memory
        (which it then becomes); None otherwise."""
        if self.shadow is None or not self._seal.signed or not self.check_launch:
            return None
        with self._lock:
            launch = self._current
        raw = self.shadow.read(self._seal.shadow_key(launch))  # (a store read: never with the lock held)
        if raw is None:
            return None
        try:
            opened = self._seal.open(raw)
        except StateRefused:
            return None
        with self._lock:
            if opened.launch != self._current or opened.seq <= self._seq:
                return None  # another launch's (this agent's changed meanwhile), or not newer than its memory
            self._seq, self._last, self._stale = opened.seq, opened.payload, False
        return opened.payload

    def _heard(self, opened: Opened) -> list[datetime]:
        """The beats in its nodes' keys of a state of a launch this agent may take, when its own record of
        them says it is not live (liveness: the record ages while a job trains); else none."""
        with self._lock:
            may_take = self.launch is None and opened.launch not in (None, self._current)
        if not (may_take and self.heard_from is not None and self._seal.signed and self.check_launch):
            return []
        if self._not_live(opened.state, []) is None or not opened.state.last_heartbeats:
            return []
        assert opened.launch is not None
        try:
            return self.heard_from(opened.launch, list(opened.state.last_heartbeats))
        except (RuntimeError, OSError, RendezvousError) as exc:  # (the state's record alone decides)
            logger.warning("could not read the heartbeats of a launch of run %s: %s", self._seal.run_id, exc)
            return []

    def _check_launch(self, opened: Opened, heard: list[datetime]) -> None:
        """Take the launch of `opened` while this agent's is tentative (if `opened` is live: its record of
        the beats, or `heard`, its nodes' keys), or refuse a state of another launch, or an older one of its
        own (called with the lock held)."""
        if opened.launch != self._current:
            if self.launch is not None:
                raise StateRefused("it belongs to another launch of this run (recorded from an earlier one, or a "
                                   "second job under the same run id and secret)")
            why = self._not_live(opened.state, heard)
            if why is not None:
                raise StateRefused(f"it was left by an earlier launch of this run ({why}): this agent starts a "
                                   "launch of its own")
            assert opened.launch is not None
            self._current, self._seq = opened.launch, 0
        if opened.seq < self._seq:
            raise StateRefused(f"it is write {opened.seq} of the launch, older than write {self._seq} this "
                               "agent has seen (a recorded state written back)")

    def _not_live(self, state: _RendezvousState, heard: list[datetime]) -> str | None:
        """Why a state of a launch this agent does not know is not one of a live launch (its record of the
        beats and `heard`, its nodes' keys); None when it is."""
        if not state.last_heartbeats:
            return "no node is in it"
        beats = [*state.last_heartbeats.values(), *heard]
        if (self._clock() - max(beats)).total_seconds() > self.live_within:
            return f"no node of it sent a heartbeat in the last {self.live_within:g} s"
        return None


def job_key(environ: Mapping[str, str] | None = None) -> PeerKey | None:
    """The job's secret the environment names (TORCHREVIVE_SNAPSHOT_SECRET_FILE, else
    TORCHREVIVE_SNAPSHOT_SECRET), or None; `peer_auth.SecretError` when it names one that cannot be read.
    (Which secret a job gets, and when none is allowed, is elastic._shared.storage.job_secret's.)"""
    return PeerKey.from_env(os.environ if environ is None else environ)
