"""Rendezvous rounds that close as soon as nobody else is coming, and waits that wake on a change.

torch's dynamic rendezvous (behind both `c10d` and our `etcd-v3`) closes a round
with fewer than MAX nodes only at its last call (`last_call_timeout` after MIN
nodes are in: 30 s by default, 2 s under torchrevive-run), and a node waiting
for the others re-reads the shared state once a second. After a worker failure
every node of the last round re-joins within a few hundred milliseconds, so
both waits are most of what a restart costs.

The handlers made by `handlers.build` change two things in torch's, nothing else:

- A round closes at once when every node of the previous round has re-joined,
  except nodes the rendezvous has since declared dead (their keep-alive
  expired), and nobody else asked to join. A node that was not in the previous
  round (a scale-up, a replacement) still gets torch's last call, since others
  may be arriving with it. The first round is torch's.
- An agent's look for nodes waiting to join (`num_nodes_waiting`, at every look at its
  workers) reads the state afresh once a change was announced, not torch's copy cached for 1 s:
  the agents of a failed worker's peers restart theirs at their next look.
- Between rounds an agent's looks cost the store nothing while nothing changes: a watcher thread
  (`ChangeSignal.latest`) blocks in the store on the key the next change will set, on a connection
  of its own, and each look reads its number. (Each look read the counter before, and the notice
  board two keys: 30 operations a node a second at torchrevive-run's 0.1 s looks, against torch's
  own handler's 2.) A look still reads the counter itself every `RESYNC_SECONDS`, so a key a
  stranger deleted or forged costs a look's latency, never a change.
- A node waiting for others wakes as soon as another node changes the
  membership (or after 1 s, torch's poll interval, so keep-alives and dead-node
  detection go on as before): every membership write bumps a counter in the
  rendezvous store (`ChangeSignal`) and sets the key for the counter's new value.
  On etcd (`EtcdStore`) a waiter watches for it, which costs etcd nothing while it
  waits. On a TCPStore (whose wait, if it times out, warns and leaves its connection
  out of step) a waiter waits on the watcher's news instead, in this process; the
  counter is polled every 5 to 50 ms only while no watcher runs. The counter lives in a `SealedStore` (its value
  sealed, and parsed by the agent, never by the store): a stranger's value
  reads as absent and is replaced, so at worst a waiter sleeps torch's 1 s.

Everything else, the state, its keys, the ranks and the timeouts, is torch's.
`--rdzv-conf quick_rounds=0` keeps torch's handler as it is.

The membership of the last completed round travels in torch's pickled state
object as two extra attributes (`LAST_ROUND`, `DEPARTED`); torch's code keeps
them, and a state without them (a fresh one) just gets torch's behaviour.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    _Action,
    _RendezvousContext,
    _RendezvousJoinOp,
    _RendezvousState,
)

from elastic._agent.rendezvous.named_events import NamedExecutor
from elastic._shared.common import threads

QUICK_ROUNDS_CONF = "quick_rounds"
"""`--rdzv-conf quick_rounds=0` leaves torch's handler unchanged."""
BOOLEANS = ("1", "true", "t", "yes", "y", "0", "false", "f", "no", "n")
"""What torch's `RendezvousParameters.get_as_bool` reads as a boolean (any case)."""
LAST_ROUND = "torchrevive_last_round"
"""Attribute of torch's state: (round number, frozenset of its nodes) of the last round this module
saw complete; it counts only for the round right after (a node with `quick_rounds=0` may have
completed a round since)."""
DEPARTED = "torchrevive_departed"
"""Attribute of torch's state: nodes of the last round since declared dead (a frozenset)."""
MAX_WAIT_SECONDS = 1.0
"""The longest a waiting node sleeps without a change: torch's own poll interval."""
POLL_FIRST_SECONDS = 0.005
POLL_MAX_SECONDS = 0.05
"""Between reads of the change counter on a store that is not watched (TCPStore)."""
KEPT_CHANGE_KEYS = 64
"""Change keys older than this many changes are deleted (a waiter that far behind wakes by timeout)."""
RESYNC_SECONDS = 5.0
"""`ChangeSignal.latest` reads the counter itself at least this often, whatever its watcher says."""
WATCH_FOR = timedelta(days=7)
"""How long the watcher's one wait may block (a TCPStore wait that times out warns, and its connection
is then out of step with the server: the watcher never lets one time out)."""
WAKE_TIMEOUT = timedelta(seconds=2)
"""The bound on the exit's one write that wakes the watcher (a stalled server: the exit's join bound then)."""
STRAY_PAUSE_SECONDS = 1.0
"""The watcher's pause when the key it waited on is set but the counter did not move (a stranger's)."""

_METHODS = {
    _Action.KEEP_ALIVE: "_keep_alive",
    _Action.ADD_TO_PARTICIPANTS: "_add_to_participants",
    _Action.ADD_TO_WAIT_LIST: "_add_to_wait_list",
    _Action.ADD_TO_REDUNDANCY_LIST: "_add_to_redundancy_list",
    _Action.REMOVE_FROM_PARTICIPANTS: "_remove_from_participants",
    _Action.REMOVE_FROM_WAIT_LIST: "_remove_from_wait_list",
    _Action.REMOVE_FROM_REDUNDANCY_LIST: "_remove_from_redundancy_list",
    _Action.MARK_RENDEZVOUS_COMPLETE: "_mark_rendezvous_complete",
    _Action.MARK_RENDEZVOUS_CLOSED: "_mark_rendezvous_closed",
}


def recorded_round(state: _RendezvousState) -> tuple[int, frozenset]:
    """(number, nodes) of the last round recorded complete; (-1, empty) when none was."""
    last = getattr(state, LAST_ROUND, None)
    if not (isinstance(last, tuple) and len(last) == 2 and isinstance(last[0], int)):
        return -1, frozenset()
    return last[0], frozenset(last[1])


def last_round_nodes(state: _RendezvousState) -> frozenset:
    """The nodes of the round before the current one, as recorded when it completed; empty
    when that round's completion was not recorded (the first round, or another executor's)."""
    number, nodes = recorded_round(state)
    return nodes if number == state.round - 1 else frozenset()


def expected_nodes(state: _RendezvousState) -> frozenset | None:
    """The nodes the current round waits for before it closes early: the last round's less
    those declared dead since; None when the last round is not known (torch's rules apply)."""
    last = last_round_nodes(state)
    if not last:
        return None
    return last - frozenset(getattr(state, DEPARTED, ()))


def closes_now(state: _RendezvousState, node: Any, min_nodes: int) -> bool:
    """Whether `node`, a participant of the open round, may mark it complete now, before the
    last call: the participants are exactly the last round's live nodes (no newcomer, none
    missing), at least `min_nodes` of them, and nobody waits to join (the wait list) or may
    join (the redundancy list: spares torch lets in as soon as a round has room)."""
    if state.closed or state.complete or node not in state.participants or state.wait_list or state.redundancy_list:
        return False
    expected = expected_nodes(state)
    if expected is None:
        return False
    present = frozenset(state.participants)
    return len(present) >= min_nodes and present == expected


class ChangeSignal:
    """Membership changes of one run, announced through a store: a counter and, with `watch`,
    a key per value.

    Invariants: a waiter that read `generation()` before it read the state, and then waits
    with `wait_after`, wakes on any change announced after that read (the counter moved;
    with `watch`, the key for the next value was set by the write that made the change),
    or at its timeout. A store that fails raises `RendezvousConnectionError`, as torch's
    backends do, so torch's handler treats it as it treats its own (at the end of a job,
    when the agent that served the store has left, one warning line, no traceback)."""

    def __init__(self, store: Any, run_id: str, *, watch: bool) -> None:
        self._store = store
        self._counter = f"torchrevive.rdzv.{run_id}.changes"
        self._watch = watch
        self._use(lambda: store.add(self._counter, 0))  # created once: reading it is then a plain read
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        """Notified whenever `_latest` moves (the watcher, `announce`): what waiters wait on."""
        self._latest = -1
        """The newest generation seen (the watcher's, or a look's own read); -1 before any."""
        self._resync_at = float("-inf")
        self._watcher: threading.Thread | None = None
        self._stopping = threading.Event()
        self._waking: tuple[Any, str] | None = None
        """The watcher's own connection for waking it at exit, and the key it waits on now."""

    def generation(self) -> int:
        """The counter, never below a change this process saw: a stranger's value reads the counter back
        from zero, and a waiter whose generation went back behind the changes it saw would wake at once,
        again and again (two agents read the state in a busy loop)."""
        value = int(self._use(lambda: self._store.add(self._counter, 0)))
        with self._lock:
            return max(value, self._latest)

    def _peek(self, store: Any) -> int | None:
        """The counter in `store`, read without writing it (a look, the watcher: neither may bring back the
        key after the run's last agent removed the run's keys); None when it cannot be read."""
        read_count = getattr(store, "read_count", None)
        if read_count is None:
            return int(store.add(self._counter, 0))
        return read_count(self._counter)

    def latest(self) -> int:
        """The newest generation announced, as the watcher last saw it: no store operation while nothing
        changes. The first call starts the watcher; the counter itself is read at the first call, again
        whenever the watcher has stopped (its store failed), and at least every `RESYNC_SECONDS`."""
        now = time.monotonic()
        with self._lock:
            watching = self._watcher is not None and self._watcher.is_alive()
            if watching and now < self._resync_at:
                return self._latest
            self._resync_at = now + RESYNC_SECONDS
        current = self._use(lambda: self._peek(self._store))
        with self._lock:
            if current is None:  # (missing or not verified: what the watcher last saw stands)
                current = max(self._latest, 0)
            self._latest = max(self._latest, current)
            if self._watcher is None and self._watch:  # (etcd: its wait is Python's, safe at finalization)
                self._watcher = threading.Thread(target=self._watch_changes, args=(current,),
                                                 name="torchrevive-rdzv-changes", daemon=True)
                self._watcher.start()
            elif self._watcher is None:  # (a TCPStore: its wait is C++'s, see `_stop_watching`)
                self._watcher = threads.start(self._watch_changes, args=(current,), name="torchrevive-rdzv-changes",
                                              stop=self._stop_watching)
            return self._latest

    def _watch_changes(self, seen: int) -> None:
        """The watcher: block on the key of the change after `seen` (set by `announce`, after the counter),
        then read the counter; until the store fails (the job ends) or the process exits (`_stop_watching`)."""
        try:
            store = self._store.clone()  # a connection of its own: a blocked wait holds its connection
            inner = getattr(store, "inner", store)  # its raw wait: any value wakes it, the counter decides
            waker = inner.clone()  # (made now: at exit a connect to a stalled server could hang)
            waker.set_timeout(WAKE_TIMEOUT)
            while not self._stopping.is_set():
                key = f"{self._counter}.{seen + 1}"
                with self._lock:
                    self._waking = (waker, key)
                inner.wait([key], WATCH_FOR)
                current = self._peek(store)
                if current is not None and current > seen:
                    seen = current
                    with self._changed:
                        self._latest = max(self._latest, current)
                        self._changed.notify_all()
                else:
                    self._stopping.wait(STRAY_PAUSE_SECONDS)
        except Exception:  # noqa: BLE001 - a store that failed or went away: looks read the counter again
            return

    def _stop_watching(self) -> None:
        """At exit (elastic._shared.common.threads): wake the watcher by setting the key it waits on, so that
        it ends before finalization. Left blocked, its wait could return while the interpreter finalizes (the
        server's agent exiting at the same time), and take the GIL back in a C++ frame: "terminate called
        without an active exception", SIGABRT, for an agent whose job had succeeded (test_slurm's
        replacement, once in a full suite). Other agents' watchers wake on that key too and find the counter
        unmoved: they read it once a `STRAY_PAUSE_SECONDS` until the next change, as after a stranger's key."""
        self._stopping.set()
        with self._lock:
            waking = self._waking
        if waking is not None:
            waker, key = waking
            try:
                waker.set(key, b"")
            except Exception:  # noqa: BLE001 - a server gone: the wait has failed, or does so now
                pass

    def announce(self) -> None:
        value = int(self._use(lambda: self._store.add(self._counter, 1)))
        with self._lock:
            behind = self._latest + 1 - value
        if behind > 0:  # read back from zero (a stranger's value): past every change seen, so watchers wake
            value = int(self._use(lambda: self._store.add(self._counter, behind)))
        self._use(lambda: self._store.set(f"{self._counter}.{value}", b"1"))
        with self._changed:
            self._latest = max(self._latest, value)
            self._changed.notify_all()
        if value > KEPT_CHANGE_KEYS:
            try:
                self._store.delete_key(f"{self._counter}.{value - KEPT_CHANGE_KEYS}")
            except Exception:  # noqa: BLE001 - best effort: a key left behind is harmless, a failed round is not
                pass

    @staticmethod
    def _use(operation: Callable[[], Any]) -> Any:
        try:
            return operation()
        except RendezvousConnectionError:
            raise
        except (RuntimeError, ValueError, TimeoutError) as exc:  # DistNetworkError, DistStoreError, etcd's
            raise RendezvousConnectionError(f"the rendezvous store failed: {exc}".splitlines()[0]) from exc

    def wait_after(self, generation: int, timeout: float) -> None:
        """Return when a change after `generation` is announced, or after `timeout` seconds. On a store
        that is not watched (TCPStore) the watcher's news, no store operation while it waits (a read of
        the counter every 5 to 50 ms before: most of a round's operations at 64 nodes); the counter
        polled only when the watcher has stopped."""
        if not self._watch:
            self.latest()  # (starts the watcher; reads the counter itself at most every RESYNC_SECONDS)
            with self._changed:
                if self._watcher is not None and self._watcher.is_alive():
                    self._changed.wait_for(lambda: self._latest > generation, timeout)
                    return
            self._poll_after(generation, time.monotonic() + timeout)
            return
        try:
            self._store.wait([f"{self._counter}.{generation + 1}"], timedelta(seconds=timeout))
        except (RuntimeError, TimeoutError):
            pass  # timed out (a store that failed says so at the next read of the state)

    def _poll_after(self, generation: int, deadline: float) -> None:
        pause = POLL_FIRST_SECONDS
        while self.generation() == generation:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(pause, left))
            pause = min(pause * 2, POLL_MAX_SECONDS)


class QuickRoundsExecutor(NamedExecutor):
    """torch's executor of rendezvous operations with the early close and the waits above.

    The loop is torch's: read (or write) the shared state, ask the operation what to do,
    do it. It differs where it waits (`ChangeSignal` instead of a 1 s sleep), where a
    join op is told to close the round (`closes_now`), and in remembering each completed
    round's nodes in the state."""

    def __init__(self, node: Any, state_holder: Any, settings: Any, signal: ChangeSignal) -> None:
        super().__init__(node, state_holder, settings)
        self._signal = signal
        self._lost_writes = 0  # compare-and-sets lost in a row (another node wrote first)

    def run(
        self,
        state_handler: Callable[[_RendezvousContext, float], _Action],
        deadline: float,
        update_deadline: Callable[[timedelta], float] | None = None,
    ) -> None:
        action: _Action | None = None
        while action != _Action.FINISH:
            generation = self._signal.generation()
            if action is None or action == _Action.SYNC or self._lost_writes == 0:
                # A fresh read after a wait: torch caches the state for 1 s, which its 1 s sleep hid. (A
                # write that lost returned the newest state already: no read of O(N) bytes again.)
                self._state_holder._last_sync_time = -1
            written = self._state_holder.sync()
            self._lost_writes = self._lost_writes + 1 if written is False else 0
            if written and action is not None and action != _Action.KEEP_ALIVE:
                self._signal.announce()  # a membership change: wake the nodes that wait for one
            elif written is False:
                time.sleep(cas_backoff(self._settings, self._lost_writes))
            self._state = self._state_holder.state
            self._note_departed()
            ctx = _RendezvousContext(self._node, self._state, self._settings)
            # (Not past the operation's deadline: there torch's op times out or rolls back.)
            if isinstance(state_handler, _RendezvousJoinOp) and time.monotonic() <= deadline and closes_now(
                self._state, self._node, self._settings.min_nodes
            ):
                action = _Action.MARK_RENDEZVOUS_COMPLETE
                print(f"torchrevive-run: rendezvous round {self._state.round} closes now: all "
                      f"{len(self._state.participants)} live nodes of the last round are back",
                      file=sys.stderr, flush=True)
            else:
                action = state_handler(ctx, deadline)
            if action == _Action.FINISH:
                continue
            if action == _Action.ERROR_CLOSED:
                raise RendezvousClosedError
            if action == _Action.ERROR_TIMEOUT:
                raise RendezvousTimeoutError
            if action == _Action.SYNC:
                self._signal.wait_after(generation, self._wait_seconds(deadline))
                continue
            getattr(self, _METHODS[action])()
            if action == _Action.REMOVE_FROM_REDUNDANCY_LIST and update_deadline:
                deadline = update_deadline(self._settings.timeout.join)  # as torch: it may join now
            self._state_holder.mark_dirty()

    def _wait_seconds(self, deadline: float) -> float:
        """Until the next thing that happens without a change: the operation's deadline, the
        round's last call, a keep-alive; at most `MAX_WAIT_SECONDS`."""
        wait = min(MAX_WAIT_SECONDS, self._settings.keep_alive_interval.total_seconds(), deadline - time.monotonic())
        if self._state.deadline is not None:
            wait = min(wait, (self._state.deadline - datetime.now(timezone.utc)).total_seconds())
        return max(wait, 0.01)

    def _note_departed(self) -> None:
        """Nodes of the last round that torch's sanitizer just declared dead (no keep-alive)."""
        # (The recorded round may still be the current one: a node can die while it trains.)
        dead = frozenset(self._state_holder._dead_nodes) & recorded_round(self._state)[1]
        if dead:
            setattr(self._state, DEPARTED, frozenset(getattr(self._state, DEPARTED, ())) | dead)

    def _mark_rendezvous_complete(self) -> None:
        super()._mark_rendezvous_complete()
        setattr(self._state, LAST_ROUND, (self._state.round, frozenset(self._state.participants)))
        setattr(self._state, DEPARTED, frozenset())


CAS_BACKOFF_FIRST_SECONDS = 0.002
CAS_BACKOFF_MAX_SECONDS = 0.5


def cas_backoff(settings: Any, lost: int) -> float:
    """Seconds to wait before writing again after `lost` compare-and-sets in a row lost to other nodes:
    torch's own setting where it has one (2.15+), else full jitter over a window that doubles from 2 ms to
    0.5 s. N nodes that all lost to one write otherwise write again at once, and all but one lose again:
    O(N^2) writes of the whole state a round (simulated at 64 nodes: about 470 store operations a node)."""
    configured = getattr(settings, "cas_backoff_max_seconds", None)
    if configured:
        return random.uniform(0, configured)
    return random.uniform(0, min(CAS_BACKOFF_MAX_SECONDS, CAS_BACKOFF_FIRST_SECONDS * 2 ** min(max(lost, 1) - 1, 16)))
