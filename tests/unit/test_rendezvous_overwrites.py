"""A stranger who can name the signed state's key (it recorded an earlier launch) overwrites it, and no
agent's write is undone, no two agents take different copies of a round, and none starts workers on a
round its peers do not share (issue 55: once, in a 2:2 job under test_store_strangers, one agent trained
alone as "rank 0 of 1" while the other waited 30 s for that round's MASTER_ADDR).

The cause, reproduced here: an agent that refused the stranger's value went on from its own older copy of
the state and wrote it back, undoing the other agent's last write (its rendezvous exit). Three layers:
the launch's shadow copy (state_shadow), the fork check (state_guard), and the round's soundness check
(handlers.unsound_round), each tested with the others out of the way."""

from __future__ import annotations

import base64
import os
import pickle
import threading
from datetime import datetime, timedelta, timezone

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import api as rendezvous_api
from torch.distributed.elastic.rendezvous.api import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _BackendRendezvousStateHolder,
    _NodeDesc,
    _RendezvousState,
)

from elastic._agent.rendezvous import handlers, store_liveness
from elastic._agent.rendezvous.guarded_c10d import C10dStateBackend
from elastic._agent.rendezvous.handlers import unsound_round
from elastic._agent.rendezvous.state_guard import StateGuard
from elastic._agent.rendezvous.state_seal import StateSeal
from elastic._agent.rendezvous.state_shadow import StateShadow
from elastic._shared.storage.peer_auth import PeerKey

RUN = "overwrites"
KEY = PeerKey(b"k" * 32)
EARLIER = "e" * 32


def recorded_state(key: PeerKey = KEY) -> bytes:
    """A state of an earlier launch of the run, sealed with the job's secret a minute ago, as torch's c10d
    backend stores it: what a stranger who recorded that launch writes back at the state's key."""
    state = _RendezvousState()
    node = _NodeDesc("10.0.0.9", 4242, 0)
    state.round, state.complete, state.participants = 9, True, {node: 0}
    state.last_heartbeats = {node: datetime.now(timezone.utc) - timedelta(seconds=60)}
    return base64.b64encode(StateSeal(RUN, key).seal(pickle.dumps(state), 40, EARLIER))


def agent(store: dist.Store, lines: list[str], *, shadow: bool) -> _BackendRendezvousStateHolder:
    """One agent's copy of the state (torch's own state holder), through a guard with or without the shadow."""
    guard = StateGuard(StateSeal(RUN, KEY), warn=lines.append)
    if shadow:
        guard.shadow = StateShadow(store)
    settings = RendezvousSettings(RUN, 1, 2, RendezvousTimeout(), timedelta(seconds=1), 3)
    holder = _BackendRendezvousStateHolder(C10dStateBackend(store, RUN, guard), settings, cache_duration=0)
    holder.state.last_heartbeats = {_NodeDesc("n1", os.getpid(), id(holder)): datetime.now(timezone.utc)}
    return holder


def write(holder: _BackendRendezvousStateHolder, round_: int) -> None:
    holder.state.round = round_
    holder.mark_dirty()
    assert holder.sync() is True


def test_an_agent_that_refuses_a_strangers_value_goes_on_from_the_launchs_latest_state() -> None:
    """b's write (round 2) is overwritten before a reads it: a goes on from the shadow copy, round 2, not from
    its own copy, round 1, and its next write builds on b's (without the shadow a wrote round 1's state back)."""
    store, lines = dist.HashStore(), []
    a, b = agent(store, lines, shadow=True), agent(store, lines, shadow=True)
    write(a, 1)
    b.sync()
    write(b, 2)
    store.set(StateSeal(RUN, KEY).store_key(), recorded_state())
    a.sync()
    assert a.state.round == 2
    a.state.wait_list = {_NodeDesc("n9", 9, 0)}
    a.mark_dirty()
    assert a.sync() is True  # its write replaces the stranger's value...
    b.sync()
    assert b.state.round == 2 and b.state.wait_list == {_NodeDesc("n9", 9, 0)}  # ...and b's write stands in it
    assert len(lines) == 1 and "belongs to another launch" not in lines[0]  # only the stranger's value refused


def test_a_write_built_on_an_older_state_after_a_refusal_is_numbered_past_every_write_so_far() -> None:
    """Without the shadow, a goes on from round 1 and writes over the stranger's value. b, whose own last writes
    (rounds 2 and 3) that undoes, takes it: numbered as a's next write it would be older than b's and refused as a
    replay, and the two would wait on each other's copies for good."""
    store, lines = dist.HashStore(), []
    a, b = agent(store, lines, shadow=False), agent(store, lines, shadow=False)
    write(a, 1)
    b.sync()
    write(b, 2)
    write(b, 3)
    store.set(StateSeal(RUN, KEY).store_key(), recorded_state())
    a.sync()
    assert a.state.round == 1  # its own copy: the shadow is what gives it b's
    write(a, 5)
    b.sync()
    assert b.state.round == 5 and len(lines) == 1  # taken, not refused as older than b's write 3
    write(b, 6)
    a.sync()
    assert a.state.round == 6


def test_a_round_a_participant_cannot_share_is_named() -> None:
    nodes = [_NodeDesc(f"n{i}", i, 0) for i in range(3)]
    state = _RendezvousState()
    state.participants = {nodes[0]: 0, nodes[1]: 1}
    assert unsound_round(state, 2) is None
    state.participants = {nodes[1]: 1}
    assert "fewer than the 2" in unsound_round(state, 2)
    assert "not 0 to 0" in unsound_round(state, 1)  # rank 1 of a world of 1
    state.participants = {nodes[0]: 0, nodes[2]: 2}
    assert "[0, 2]" in unsound_round(state, 1)


def in_process_handlers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Lets handlers made by `handler` form rounds in this process, without a store server or a free port;
    the lines their module prints go to the list returned."""
    lines: list[str] = []
    monkeypatch.setenv("TORCHREVIVE_ROUND", "")  # the handler tells its workers their round there
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as torchrevive-run: no store server here
    monkeypatch.setattr(rendezvous_api, "get_free_port", lambda: 29500)  # (it listens to find one; no workers start)
    monkeypatch.setattr(handlers, "print", lambda *args, **kwargs: lines.append(args[0]), raising=False)
    return lines


def handler(store: dist.Store, key: PeerKey, **conf: str) -> handlers.SealedHandler:
    """A c10d-sealed agent's handler as `create_c10d_sealed` makes it, on an in-process store (`conf`: more
    of `--rdzv-conf`, or other values)."""
    conf = {"join_timeout": "30", "last_call_timeout": "1", "close_timeout": "5", **conf}
    params = RendezvousParameters("c10d-sealed", "127.0.0.1:29400", RUN, 2, 2, **conf)
    backend = C10dStateBackend(store, RUN, StateGuard.for_run(RUN, key), name="c10d-sealed")
    return handlers.build(params, backend, store, key, watch=False, heartbeats=store_liveness.key_heartbeats)


@pytest.mark.parametrize("shadow", [True, False], ids=["shadow", "soundness check alone"])
def test_two_agents_restarting_under_a_stranger_who_overwrites_each_write_of_one_agree_on_every_round(
    monkeypatch: pytest.MonkeyPatch, shadow: bool
) -> None:
    """Two c10d-sealed handlers in threads form a round, then both join the next, while a stranger overwrites
    the state's key after each write of b (its exit, its wait) until a has written once (its exit). They end in
    the same round, each with world size 2. Without the shadow, a writes its older copy back and b finishes the old
    round alone ("rank 1 of 1"): the soundness check makes it join again instead."""
    lines = in_process_handlers(monkeypatch)
    store = dist.HashStore()
    a, b = handler(store, KEY), handler(store, KEY)
    if not shadow:
        a.guard.shadow = b.guard.shadow = None
    results: dict[str, tuple[int, int, int]] = {}

    def join(name: str, agent: handlers.SealedHandler) -> None:
        info = agent.next_rendezvous()
        results[name] = (agent._state_holder.state.round, info.rank, info.world_size)

    first = [threading.Thread(target=join, args=(n, h)) for n, h in (("a", a), ("b", b))]
    for thread in first:
        thread.start()
    for thread in first:
        thread.join(60)
    assert results["a"][0] == results["b"][0] == 0 and {results["a"][2], results["b"][2]} == {2}

    b_writes = threading.Semaphore(0)
    armed = threading.Event()
    backend = b._state_holder._backend
    set_state = backend.set_state

    def overwritten_after_each_win(state, token=None):
        result = set_state(state, token)
        if armed.is_set() and result is not None and result[2]:
            store.set(b.guard.store_key, recorded_state())
            b_writes.release()
        return result

    backend.set_state = overwritten_after_each_win
    a_backend = a._state_holder._backend
    a_set_state = a_backend.set_state

    def disarm_after_a_win(state, token=None):
        result = a_set_state(state, token)
        if armed.is_set() and result is not None and result[2]:
            armed.clear()
        return result

    a_backend.set_state = disarm_after_a_win
    armed.set()
    second_b = threading.Thread(target=join, args=("b", b))
    second_b.start()
    assert b_writes.acquire(timeout=30) and b_writes.acquire(timeout=30)  # b left round 0 and waits for round 1
    second_a = threading.Thread(target=join, args=("a", a))
    second_a.start()
    second_a.join(60)
    second_b.join(60)
    assert not second_a.is_alive() and not second_b.is_alive()
    assert results["a"][0] == results["b"][0] >= 1, results
    assert sorted([results["a"][1], results["b"][1]]) == [0, 1] and results["a"][2] == results["b"][2] == 2, results
    assert any("joins again" in line for line in lines) is (not shadow), lines
    for agent in (a, b):
        agent.shutdown()
