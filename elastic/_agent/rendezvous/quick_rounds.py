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
  rendezvous store (`ChangeSignal`, change_signal.py) and sets the key for the counter's new value.
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
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    _Action,
    _RendezvousContext,
    _RendezvousJoinOp,
    _RendezvousState,
)

from elastic._agent.rendezvous.change_signal import ChangeSignal
from elastic._agent.rendezvous.named_events import NamedExecutor
from elastic._agent.timings import CAS_BACKOFF_FIRST_SECONDS, CAS_BACKOFF_MAX_SECONDS, MAX_WAIT_SECONDS

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


def cas_backoff(settings: Any, lost: int) -> float:
    """Seconds to wait before writing again after `lost` compare-and-sets in a row lost to other nodes:
    torch's own setting where it has one (2.15+), else full jitter over a window that doubles from 2 ms to
    0.5 s. N nodes that all lost to one write otherwise write again at once, and all but one lose again:
    O(N^2) writes of the whole state a round (simulated at 64 nodes: about 470 store operations a node)."""
    configured = getattr(settings, "cas_backoff_max_seconds", None)
    if configured:
        return random.uniform(0, configured)
    return random.uniform(0, min(CAS_BACKOFF_MAX_SECONDS, CAS_BACKOFF_FIRST_SECONDS * 2 ** min(max(lost, 1) - 1, 16)))
