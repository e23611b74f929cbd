"""A stranger who recorded an earlier launch writes its state over the first round's before the two agents
of a signed job have met: each agent refuses it and goes on from its own copy, in a launch of its own. They
still meet (issue 52: under a loaded full suite, test_store_strangers' two agents each waited out the 60 s
join timeout, and the job ended with exit 1).

The cause, reproduced here: a refused value stayed in the store for as long as no agent had a reason to
write. Heartbeats in keys of their own (liveness) keep each copy fresh without a write, so nobody wrote,
and neither agent could ever read the other's launch. An agent that refused the store's value now writes its
own state back at its next look, as torch's retry would after a lost write, and the other agent reads it.

And a stranger's value in the change counter read the counter back from zero: a waiter whose last change
was past that woke at once, and the two agents read the store in a busy loop (1,252 reads in 0.55 s)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
from test_rendezvous_overwrites import KEY, RUN, handler, in_process_handlers, recorded_state

from elastic._agent.rendezvous import handlers
from elastic._agent.rendezvous.change_signal import ChangeSignal
from elastic._shared.protocol import round_identity
from elastic._shared.storage.sealed_store import SealedStore


def overwrite_first_write(agent: handlers.SealedHandler, store: dist.Store, done: threading.Event) -> None:
    """The stranger writes the recorded state over `agent`'s first won write (its join), then sets `done`."""
    backend = agent._state_holder._backend
    set_state = backend.set_state

    def overwritten_once(state, token=None):
        result = set_state(state, token)
        if not done.is_set() and result is not None and result[2]:
            store.set(agent.guard.store_key, recorded_state())
            done.set()
        return result

    backend.set_state = overwritten_once


def test_two_agents_whose_joins_a_stranger_overwrote_before_they_met_still_form_the_first_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """a joins; its state is overwritten before b reads it, so b refuses the stranger's, starts a launch of its
    own and joins it; b's state is overwritten before a reads it. Each then waits in its own launch, reading
    only the stranger's value. They form round 0 together, each with world size 2, in one launch."""
    in_process_handlers(monkeypatch)
    store = dist.HashStore()
    # torchrevive-run's 1 s keep-alive (heartbeats in keys of their own: nothing else makes an agent write)
    a, b = (handler(store, KEY, join_timeout="20", keep_alive_interval="1", keep_alive_max_attempt="3") for _ in "ab")
    a_overwritten, b_overwritten = threading.Event(), threading.Event()
    overwrite_first_write(a, store, a_overwritten)
    overwrite_first_write(b, store, b_overwritten)
    results: dict[str, tuple[int, int, int]] = {}
    errors: list[BaseException] = []

    def join(name: str, agent: handlers.SealedHandler) -> None:
        try:
            info = agent.next_rendezvous()
            results[name] = (agent._state_holder.state.round, info.rank, info.world_size)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = {"a": threading.Thread(target=join, args=("a", a)), "b": threading.Thread(target=join, args=("b", b))}
    threads["a"].start()
    assert a_overwritten.wait(30)
    threads["b"].start()
    assert b_overwritten.wait(30)
    for thread in threads.values():
        thread.join(60)
    assert not errors, errors  # (without the fix: each agent's join times out)
    assert results["a"][0] == results["b"][0] == 0 and results["a"][2] == results["b"][2] == 2, results
    assert sorted([results["a"][1], results["b"][1]]) == [0, 1], results
    assert a.guard.launch == b.guard.launch is not None
    assert a.guard.refused >= 1 and b.guard.refused >= 1  # both met the stranger's value
    for agent in (a, b):
        agent.shutdown()


def test_a_strangers_value_in_the_change_counter_never_takes_a_waiters_generation_back() -> None:
    """After the counter is read back from zero, the generation a waiter reads is still past every change it
    saw (a waiter behind it would wake at once, again and again), and the next change is announced past it:
    the watchers, which wait on the key of the change after the last they saw, wake on it."""
    store = dist.HashStore()
    signal = ChangeSignal(SealedStore(store, KEY, round_identity.changes_scope(RUN)), RUN, watch=False)
    signal.announce()
    signal.announce()
    assert signal.generation() == 2
    store.set(f"torchrevive.rdzv.{RUN}.changes", "x")  # the stranger's
    assert signal.generation() == 2
    watcher = dist.HashStore.wait  # (a watcher of another agent waits on the key of change 3)
    signal.announce()
    assert signal.generation() == 3
    watcher(store, [f"torchrevive.rdzv.{RUN}.changes.3"], timedelta(seconds=1))  # set: returns at once
