"""Every rendezvous handler of torchrevive-run, and of plain torchrun on our backends, is made here.

torchrun finds a backend's handler creator through torch's `torchrun.handlers` entry points
(pyproject.toml: `c10d-sealed`, `etcd-v3`) and registers it in torch's `rendezvous_handler_registry`;
torchrevive-run registers the same creators the same way (`register`) and asks for them by name
(`launcher_backend`: `c10d`, `--standalone` and a one-node `static` are `c10d-sealed`). No torch
function is replaced.

Every handler made here is a `SealedHandler`, torch's `DynamicRendezvousHandler` subclassed:
- its state goes through a `StateGuard` (signed with the job's secret, read by a restricted
  unpickler, bound to the launch: state_guard);
- the store torch's agent is handed each round is a `SealedStore` in the launch's scope: the
  assigned ranks, MASTER_ADDR and MASTER_PORT, the exit barrier, the notices and the heals go
  through it (elastic._shared.storage.sealed_store);
- quick rounds (quick_rounds), unless `--rdzv-conf quick_rounds=0`;
- each node's heartbeat in a key of its own, sealed like the store's values, not torch's whole state
  rewritten every interval (liveness: c10d-sealed's in the store, store_liveness; etcd-v3's on a lease per
  node, etcd_liveness);
- its events named without `inspect.stack()` (named_events);
- at each round it tells this agent's workers their launch and round, the scope of their worker
  store (elastic._shared.protocol.round_identity).

Which secret a job signs with, and whether it may go without one, is job_secret's: a creator that
cannot have the secret it needs ends the agent with one line and exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

from torch.distributed import Store
from torch.distributed.elastic.events import NodeState, construct_and_record_rdzv_event
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.api import (
    RendezvousError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    create_handler,
)

from elastic._agent.rendezvous import c10d_store, store_liveness
from elastic._agent.rendezvous.change_signal import ChangeSignal
from elastic._agent.rendezvous.guarded_c10d import C10dStateBackend
from elastic._agent.rendezvous.liveness import Heartbeats, HeartbeatStateHolder
from elastic._agent.rendezvous.named_events import NamedExecutor, method_name
from elastic._agent.rendezvous.quick_rounds import QUICK_ROUNDS_CONF, QuickRoundsExecutor
from elastic._agent.rendezvous.state_guard import StateGuard
from elastic._agent.rendezvous.state_shadow import StateShadow
from elastic._agent.timings import FULL_READ_EVERY_S
from elastic._shared.common.errors import UsageError
from elastic._shared.protocol import round_identity
from elastic._shared.protocol.round_identity import RoundIdentity
from elastic._shared.storage import job_secret
from elastic._shared.storage.peer_auth import PeerKey, SecretError
from elastic._shared.storage.sealed_store import SealedStore

C10D_SEALED = "c10d-sealed"
ETCD_V3 = "etcd-v3"
SEALED_BACKENDS = (C10D_SEALED, ETCD_V3)


Scope = Callable[[str], str]
"""The scope a launch's values in the agents' store are sealed in."""
MakeHeartbeats = Callable[[Any, Any, SealedStore, Scope], Heartbeats]
"""Heartbeats for torch's node with rendezvous settings, sealed as the agents' store seals (liveness)."""


class UnsoundRound(RendezvousError):
    """This agent's copy of a completed round is not one its participants can share (`unsound_round`)."""


def unsound_round(state: Any, min_nodes: int) -> str | None:
    """Why a completed round, as `state` (torch's `_RendezvousState`) holds it, cannot be the one every
    participant joined; None when it can be. torch completes a round with at least `min_nodes` participants
    ranked 0..N-1; a copy with fewer, or with a gap, is one whose writes were partly undone (a write built
    on an older state, after a stranger overwrote the newest), or one a participant left since."""
    ranks = sorted(state.participants.values())
    if len(ranks) < min_nodes:
        return f"has {len(ranks)} participant(s), fewer than the {min_nodes} a round needs"
    if ranks != list(range(len(ranks))):
        return f"ranks its participants {ranks}, not 0 to {len(ranks) - 1}"
    return None


class GuardedStateHolder(HeartbeatStateHolder):
    """torch's state holder (heartbeats from keys) on a guarded backend: after a read its guard refused, the
    next sync writes this agent's copy back, as torch's retry does after a write another agent won.

    Why: the refused value (a stranger's, or one recorded from an earlier launch) stays in the store until
    an agent writes, and with heartbeats in keys of their own a waiting agent has no reason to. Two agents
    whose first writes a stranger overwrote before they met then waited out their join timeout, each in a
    launch of its own, each reading only the stranger's value (tests/unit/test_rendezvous_first_round_overwrites).
    Written back, the store holds a state of a live launch again, which the other agent can read and take.

    Invariant: a sync that saw a refusal leaves the copy dirty; the write that follows is the guard's (the
    shadow's newer copy, or its own copy numbered past every write it saw: state_guard)."""

    def __init__(self, backend: RendezvousBackend, settings: Any, guard: StateGuard) -> None:
        super().__init__(backend, settings)
        self._guard = guard

    def sync(self) -> bool | None:
        refused = self._guard.refused
        written = super().sync()
        if self._guard.refused != refused:
            self.mark_dirty()
        return written


class SealedHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous handler, as the module docstring says; `leaving(closed)` runs after
    `shutdown` (the etcd-v3 backend leaves etcd there)."""

    heartbeats: Heartbeats | None = None
    """This node's heartbeats in keys of their own (liveness); None: torch's, in the state."""

    def __init__(
        self, parsed: DynamicRendezvousHandler, backend: RendezvousBackend, store: SealedStore, guard: StateGuard,
        signal: ChangeSignal | None, leaving: Callable[[bool], None] | None = None,
    ) -> None:
        """`parsed`: torch's own handler for the same parameters, whose node and settings this one takes."""
        node, settings = parsed._this_node, parsed._settings
        super().__init__(node, settings, backend.name, store, GuardedStateHolder(backend, settings, guard))
        self.guard = guard
        guard.live_within = settings.keep_alive_interval.total_seconds() * settings.keep_alive_max_attempt
        self._signal = signal
        self._leaving = leaving
        self._seen_generation: int | None = None
        self._last_full_read = float("-inf")
        self._op_executor = (NamedExecutor(node, self._state_holder, settings) if signal is None
                             else QuickRoundsExecutor(node, self._state_holder, settings, signal))

    @property
    def changes(self) -> ChangeSignal | None:
        """The run's change signal (quick rounds; None without): the notice board announces its posts on it,
        so that a look reads the board only after a change (notice_board.StoreBoard)."""
        return self._signal

    def use_heartbeats(self, heartbeats: Heartbeats) -> None:
        """From now on this node beats through `heartbeats`, its copies of the state learn the others' beats
        there, and the guard asks them whether a launch it meets is live (see liveness)."""
        self.heartbeats = heartbeats
        self._state_holder.heartbeats = heartbeats
        self.guard.heard_from = heartbeats.heard_from

    def _keep_alive(self) -> None:
        """torch's heartbeat timer's work: this node's own key (O(1) bytes), or torch's state rewrite."""
        if self.heartbeats is None:
            super()._keep_alive()
            return
        with self._heartbeat_lock:  # as torch's: never in the middle of this agent's own rendezvous step
            self.heartbeats.beat()

    def _record(self, message: str, node_state: NodeState = NodeState.RUNNING, rank: int | None = None) -> None:
        construct_and_record_rdzv_event(
            name=f"{self.__class__.__name__}.{method_name()}", run_id=self._settings.run_id, message=message,
            node_state=node_state, hostname=self._this_node.addr, pid=self._this_node.pid,
            local_id=self._this_node.local_id, rank=rank,
        )

    def next_rendezvous(self) -> RendezvousInfo:
        deadline = time.monotonic() + self._settings.timeout.join.total_seconds()
        while True:
            try:
                info = super().next_rendezvous()
                break
            except UnsoundRound as why:  # this agent's copy of the round is not one its peers share: join again
                if time.monotonic() > deadline:
                    raise RendezvousTimeoutError(f"rendezvous '{self._settings.run_id}': {why}") from None
                print(f"torchrevive: warning: rendezvous '{self._settings.run_id}': round "
                      f"{self._state_holder.state.round} as this agent read it {why}; it joins again",
                      file=sys.stderr, flush=True)
        self.guard.fix()  # the launch this round completed in is this agent's for good
        if self.guard.launch is not None:  # (an unsigned job's workers get no scope: their store is unsealed)
            round_identity.publish(RoundIdentity(self.guard.launch, self._state_holder.state.round), os.environ)
        return info

    def _get_world(self) -> tuple[int, int]:
        """torch's rank and world size in the round this agent just finished joining; `UnsoundRound` when its
        copy of the round is not one every participant can share (`unsound_round`): starting workers on it
        would leave a peer waiting for a rank nobody holds, or a rank training alone below the minimum."""
        why = unsound_round(self._state_holder.state, self._settings.min_nodes)
        if why is not None:
            raise UnsoundRound(why)
        return super()._get_world()

    def num_nodes_waiting(self) -> int:
        """torch's answer (quick rounds), from the state read at the last announced membership change, and
        read afresh at the next: a node that failed and joins the next round is on the wait list, and the
        other agents restart their workers at their next look instead of up to a second later. No store
        operation per look while nothing changed (the change signal's watcher: `ChangeSignal.latest`), and
        no read of the whole state (O(N) bytes, every second under torch's 1 s cache): the wait list
        changes only by a membership write, announced."""
        if self._signal is None:
            return super().num_nodes_waiting()
        generation = self._signal.latest()
        now = time.monotonic()
        if generation != self._seen_generation or now - self._last_full_read >= FULL_READ_EVERY_S:
            self._state_holder._last_sync_time = -1  # read the state now, not torch's cached copy
            self._last_full_read = now
        else:
            self._state_holder._last_sync_time = now  # nothing announced since: torch's copy is current
        waiting = super().num_nodes_waiting()
        self._seen_generation = generation
        return waiting

    def shutdown(self) -> bool:
        closed = False
        try:
            closed = super().shutdown()
            return closed
        finally:
            if self._leaving is not None:
                self._leaving(closed)


def build(
    params: RendezvousParameters, backend: Any, inner: Store, key: PeerKey | None, *, watch: bool,
    leaving: Callable[[bool], None] | None = None, heartbeats: MakeHeartbeats | None = None,
) -> SealedHandler:
    """The handler for `params` on `backend` (whose `guard` guards its state) and the store `inner`, its
    heartbeats made by `heartbeats` (None: torch's, in the state)."""
    guard: StateGuard = backend.guard
    run_id = params.run_id

    def scope_of(launch: str) -> str:
        return round_identity.rendezvous_scope(run_id, launch)

    def scope() -> str | None:
        launch = guard.current_launch
        return None if launch is None else scope_of(launch)

    store = SealedStore(inner.clone(), key, scope)
    if key is not None:
        guard.shadow = StateShadow(inner)  # the state's key is known to recordings of other launches: copy it
    signal = None
    if params.get_as_bool(QUICK_ROUNDS_CONF, True):
        signal = ChangeSignal(SealedStore(inner, key, round_identity.changes_scope(run_id)), run_id, watch=watch)
    handler = SealedHandler(create_handler(store, backend, params), backend, store, guard, signal, leaving)
    if heartbeats is not None:
        handler.use_heartbeats(heartbeats(handler._this_node, handler._settings, store, scope_of))
    return handler


def create_c10d_sealed(params: RendezvousParameters) -> SealedHandler:
    """`--rdzv-backend=c10d-sealed`: torch's c10d rendezvous, its store on the endpoint's address
    (c10d_store), every value sealed."""
    key = _job_key(params)
    inner = c10d_store.create_store(params)
    guard = StateGuard.for_run(params.run_id, key)
    return build(params, C10dStateBackend(inner, params.run_id, guard, name=params.backend), inner, key, watch=False,
                 heartbeats=store_liveness.key_heartbeats)


def create_etcd_v3(params: RendezvousParameters) -> SealedHandler:
    """`--rdzv-backend=etcd-v3` (elastic._agent.rendezvous.etcd): reopens the run first if a job that
    has ended left it closed, announces this agent, keeps its node's heartbeat on a lease
    (etcd_liveness), and leaves etcd cleanly at `shutdown()`."""
    from elastic._agent.rendezvous import etcd, etcd_liveness, etcd_reopen
    from elastic._agent.rendezvous.etcd_options import EtcdOptions, EtcdOptionsError

    try:  # every option checked before anything is made or reached
        liveness_ttl = etcd.positive_int(params, "liveness_ttl", etcd.DEFAULT_LIVENESS_TTL)
        join_timeout = etcd.positive_int(params, "join_timeout", etcd.DEFAULT_JOIN_TIMEOUT)
        EtcdOptions.from_params(params)
    except EtcdOptionsError as exc:
        _refuse(params, str(exc))
    key = _job_key(params)
    backend, store = etcd.create_backend(params, key)
    keys = etcd_reopen.RunKeys(backend.client.options.key_prefix.encode())
    presences: list[etcd_liveness.AgentPresence] = []

    def lease_heartbeats(node: Any, settings: Any, sealed: SealedStore, scope_of: Scope) -> Heartbeats:
        heartbeats, presence = etcd_liveness.lease_heartbeats(
            node, settings, backend.client.options, backend.client, keys.alive, sealed, scope_of)
        presences.append(presence)
        return heartbeats

    def leaving(closed: bool) -> None:
        etcd_reopen.leave(closed, backend, store, params, keys, presences)

    try:
        etcd_reopen.reopen_closed_run(backend, store, params, keys, timeout=join_timeout)
        presences.append(etcd_liveness.AgentPresence(backend.client.options, keys.agents, liveness_ttl))
        presences[0].enter()
        return build(params, backend, store, key, watch=True, leaving=leaving, heartbeats=lease_heartbeats)
    except BaseException:
        for presence in presences:
            presence.leave()
        backend.client.close()  # nothing of this agent is in etcd any more
        raise


CREATORS: dict[str, Callable[[RendezvousParameters], SealedHandler]] = {
    C10D_SEALED: create_c10d_sealed,
    ETCD_V3: create_etcd_v3,
}


def register() -> None:
    """Register every backend here in torch's registry, as torch's entry points would (idempotent:
    torch takes the same creator again)."""
    for name, creator in CREATORS.items():
        rendezvous_handler_registry.register(name, creator)


def launcher_backend(args: argparse.Namespace) -> None:
    """torchrevive-run's `--rdzv-backend`, one made here: `c10d` is `c10d-sealed`, as is a one-node
    `static` job (on a store of its own on the loopback); `UsageError` for any other."""
    backend = args.rdzv_backend
    if backend == "c10d":
        args.rdzv_backend = C10D_SEALED
    elif backend == "static" and str(args.nnodes or "1").split(":")[-1] == "1":
        args.rdzv_backend, args.rdzv_endpoint = C10D_SEALED, "127.0.0.1:0"
    elif backend not in SEALED_BACKENDS:
        raise UsageError(f"--rdzv-backend={backend}: torchrevive-run authenticates every value its agents read from "
                         "the rendezvous, which it can do on c10d and etcd-v3: use --rdzv-backend=c10d (or etcd-v3)")


def _job_key(params: RendezvousParameters) -> PeerKey | None:
    """The job's secret (job_secret); one line and exit 2 when it cannot be had."""
    try:
        return job_secret.for_rendezvous(params.run_id, endpoint=params.endpoint, max_nodes=params.max_nodes)
    except SecretError as exc:
        _refuse(params, str(exc))


def _refuse(params: RendezvousParameters, line: str) -> NoReturn:
    """End the agent with one line and exit 2 (a traceback would bury it, and torchrun would show it once
    per agent)."""
    print(f"torchrun: error: --rdzv-backend={params.backend}: {line}", file=sys.stderr, flush=True)
    raise SystemExit(2)
