"""Quick rendezvous rounds (elastic._agent.rendezvous.quick_rounds) in the handlers the factory makes
(elastic._agent.rendezvous.handlers: c10d-sealed).

Several handlers in one process play the agents of a job, on a real TCPStore. The
rounds whose close would otherwise wait for the last call use `last_call_timeout`
of 600 s: a round that completes at all within the test's join timeout closed
early, which needs no clock in the assertion.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    _NodeDesc,
    _RendezvousState,
)

from elastic._agent.rendezvous import change_signal, named_events
from elastic._agent.rendezvous.change_signal import ChangeSignal
from elastic._agent.rendezvous.handlers import create_c10d_sealed
from elastic._agent.rendezvous.quick_rounds import (
    DEPARTED,
    LAST_ROUND,
    QuickRoundsExecutor,
    closes_now,
    expected_nodes,
)
from elastic._shared.protocol.recovery_defaults import FRESH_STORE_ENV
from elastic._shared.storage.peer_auth import SECRET_FILE_ENV

JOIN_TIMEOUT = 120  # what a round that waited for its 600 s last call would run into
NO_TIMEOUT = 3600.0  # far beyond pytest's timeout: a lost wake fails the test instead of passing late


def node(i: int) -> _NodeDesc:
    return _NodeDesc(f"host{i}", 100 + i, 0)


def state_with(participants, *, last=None, departed=(), wait_list=(), spares=(), complete=False,
               last_number: int = 4) -> _RendezvousState:
    """Round 5 of a rendezvous; `last`: the nodes recorded for round `last_number` when it completed."""
    state = _RendezvousState()
    state.round = 5
    state.participants = {n: 0 for n in participants}
    state.wait_list = set(wait_list)
    state.redundancy_list = set(spares)
    state.complete = complete
    if last is not None:
        setattr(state, LAST_ROUND, (last_number, frozenset(last)))
        setattr(state, DEPARTED, frozenset(departed))
    return state


# --- the rule ------------------------------------------------------------------------


def test_a_round_closes_once_every_node_of_the_last_round_is_back() -> None:
    a, b = node(1), node(2)
    assert closes_now(state_with([a, b], last=[a, b]), a, min_nodes=1)
    assert not closes_now(state_with([a], last=[a, b]), a, min_nodes=1)  # b is still coming


def test_a_node_declared_dead_is_not_waited_for() -> None:
    a, b = node(1), node(2)
    assert expected_nodes(state_with([a], last=[a, b], departed=[b])) == {a}
    assert closes_now(state_with([a], last=[a, b], departed=[b]), a, min_nodes=1)


def test_a_newcomer_a_waiting_node_or_a_spare_gets_the_last_call() -> None:
    a, b, c = node(1), node(2), node(3)
    assert not closes_now(state_with([a, b, c], last=[a, b]), a, min_nodes=1)  # c is new
    assert not closes_now(state_with([a, b], last=[a, b], wait_list=[c]), a, min_nodes=1)
    assert not closes_now(state_with([a, b], last=[a, b], spares=[c]), a, min_nodes=1)  # torch lets it in now


def test_only_the_round_right_before_counts() -> None:
    """A round completed by another executor (a node with quick_rounds=0) records nothing: the
    record of an older round must not close this one while one of the true last round's nodes
    is between its exit and its join."""
    a, b = node(1), node(2)
    assert closes_now(state_with([a], last=[a], last_number=4), a, min_nodes=1)
    assert not closes_now(state_with([a], last=[a], last_number=3), a, min_nodes=1)
    assert expected_nodes(state_with([a, b], last=[a, b], last_number=3)) is None


def test_the_first_round_too_few_nodes_and_outsiders_follow_torch() -> None:
    a, b = node(1), node(2)
    assert not closes_now(state_with([a, b]), a, min_nodes=1)  # no last round: torch's rules
    assert not closes_now(state_with([a], last=[a, b], departed=[b]), a, min_nodes=2)
    assert not closes_now(state_with([a, b], last=[a, b]), node(9), min_nodes=1)  # not a participant
    assert not closes_now(state_with([a, b], last=[a, b], complete=True), a, min_nodes=1)


# --- the change signal -------------------------------------------------------------------


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield server


@pytest.mark.parametrize("watch", [True, False], ids=["watched", "polled"])
def test_a_waiter_wakes_on_a_change_announced_after_its_read(store, watch) -> None:
    signal = ChangeSignal(store, "job", watch=watch)
    seen = signal.generation()
    woke = threading.Event()

    def wait() -> None:
        signal.wait_after(seen, timeout=NO_TIMEOUT)
        woke.set()

    waiter = threading.Thread(target=wait)
    waiter.start()
    other = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))
    ChangeSignal(other, "job", watch=watch).announce()
    waiter.join()
    assert woke.is_set()
    assert signal.generation() == seen + 1


@pytest.mark.parametrize("watch", [True, False], ids=["watched", "polled"])
def test_a_change_between_the_read_and_the_wait_is_not_missed(store, watch) -> None:
    signal = ChangeSignal(store, "job", watch=watch)
    seen = signal.generation()
    signal.announce()
    signal.wait_after(seen, timeout=NO_TIMEOUT)  # returns at once: the change is already there


@pytest.mark.parametrize("watch", [True, False], ids=["watched", "polled"])
def test_a_wait_without_a_change_ends_at_its_timeout(store, watch) -> None:
    signal = ChangeSignal(store, "job", watch=watch)
    signal.wait_after(signal.generation(), timeout=0.05)  # no exception, no hang


def test_on_etcd_a_waiter_watches_and_reading_the_counter_writes_nothing(shared_etcd) -> None:
    from elastic._agent.rendezvous.etcd import create_backend

    params = RendezvousParameters(backend="etcd-v3", endpoint=shared_etcd.endpoint, run_id="quick-watch",
                                  min_nodes=1, max_nodes=1)
    stores = [create_backend(params, None)[1] for _ in range(2)]
    waiting, announcing = ChangeSignal(stores[0], "job", watch=True), ChangeSignal(stores[1], "job", watch=True)
    keys = stores[0].num_keys()
    for _ in range(5):
        seen = waiting.generation()
    assert stores[0].num_keys() == keys, "a read of the counter left keys behind"
    woke = threading.Event()
    waiter = threading.Thread(target=lambda: (waiting.wait_after(seen, timeout=NO_TIMEOUT), woke.set()))
    waiter.start()
    announcing.announce()
    waiter.join()
    assert woke.is_set() and waiting.generation() == seen + 1


def test_old_change_keys_are_deleted(store) -> None:
    signal = ChangeSignal(store, "job", watch=True)
    for _ in range(change_signal.KEPT_CHANGE_KEYS + 3):
        signal.announce()
    assert not store.check(["torchrevive.rdzv.job.changes.1"])
    assert store.check([f"torchrevive.rdzv.job.changes.{change_signal.KEPT_CHANGE_KEYS + 3}"])


def test_a_store_whose_server_left_is_torchs_connection_error_not_a_traceback() -> None:
    """At a job's end the agent serving the c10d store may leave first: torch's handler turns a
    RendezvousConnectionError into one warning line at shutdown, any other error into a traceback."""
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=2))
    signal = ChangeSignal(client, "job", watch=False)
    del server  # the serving agent is gone
    with pytest.raises(RendezvousConnectionError, match="the rendezvous store failed"):
        signal.generation()
    with pytest.raises(RendezvousConnectionError):
        signal.announce()


# --- handlers ------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def store_per_round(monkeypatch, tmp_path) -> None:
    """As torchrevive-run runs its handlers (with torch's shared store a node that joins after the
    first round waits for a store address nobody publishes again), with the job's secret given."""
    monkeypatch.setenv(FRESH_STORE_ENV, "1")
    secret = tmp_path / "secret"
    secret.write_text("r" * 32)
    monkeypatch.setenv(SECRET_FILE_ENV, str(secret))


def agents(store, count: int, *, max_nodes: int, last_call: float, quick: bool = True, **conf) -> list:
    """`count` agents' handlers, as the factory makes them (c10d-sealed, clients of `store`)."""
    return [create_c10d_sealed(RendezvousParameters(
        backend="c10d-sealed", endpoint=f"127.0.0.1:{store.port}", run_id="quick", min_nodes=1, max_nodes=max_nodes,
        join_timeout=str(JOIN_TIMEOUT), last_call_timeout=str(last_call), keep_alive_interval="1",
        keep_alive_max_attempt="3", quick_rounds="1" if quick else "0", is_host="0", read_timeout=str(JOIN_TIMEOUT),
        **conf,
    )) for _ in range(count)]


def join_all(handlers) -> list[tuple[int, int]]:
    """(rank, world size) of each handler's next round, joined at the same time."""
    with ThreadPoolExecutor(len(handlers)) as pool:
        infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
    return [(info.rank, info.world_size) for info in infos]


def leave(handlers) -> None:
    for handler in handlers:
        handler._stop_heartbeats()


def test_quick_rounds_0_leaves_torchs_rounds_as_they_are(store) -> None:
    slow, = agents(store, 1, max_nodes=2, last_call=1, quick=False)
    assert isinstance(slow, DynamicRendezvousHandler)
    assert not isinstance(slow._op_executor, QuickRoundsExecutor)
    fast, = agents(store, 1, max_nodes=2, last_call=1)
    assert isinstance(fast._op_executor, QuickRoundsExecutor)


def test_rendezvous_events_keep_torchs_names(store, monkeypatch) -> None:
    """torch names each event by its caller; the factory's handlers find the caller without inspect.stack(),
    and torch's own `get_method_name` is left as it is (no torch function is replaced)."""
    import logging

    from torch.distributed.elastic import events
    from torch.distributed.elastic.events import handlers as event_handlers

    recorded = []
    monkeypatch.setitem(event_handlers._log_handlers, "dynamic_rendezvous", logging.Handler())  # not a NullHandler
    monkeypatch.setattr(events, "record_rdzv_event", recorded.append)
    handlers = agents(store, 2, max_nodes=2, last_call=600)
    assert dynamic_rendezvous.get_method_name.__module__ == dynamic_rendezvous.__name__
    try:
        join_all(handlers)
    finally:
        leave(handlers)
    names = {event.name.partition(":")[2] for event in recorded}  # (torch prefixes the file that recorded it)
    assert {
        "SealedHandler.next_rendezvous",
        "QuickRoundsExecutor._add_to_participants",
        "QuickRoundsExecutor._mark_rendezvous_complete",
    } <= names, names
    assert not any("no_method_name" in name for name in names), names


def test_method_name_is_torchs_get_method_name() -> None:
    import inspect

    def torchs(depth=2):  # torch's get_method_name, as torch 2.14 has it
        if len(inspect.stack()) > depth:
            return inspect.stack()[depth].function
        return "no_method_name"

    def caller():
        return record()

    def record():
        return [(torchs(depth), named_events.method_name(depth)) for depth in (0, 1, 2, 3, 10_000)]

    for theirs, ours in caller():
        assert (theirs == "torchs") == (ours == "method_name")  # each names itself at depth 0
        if theirs != "torchs":
            assert ours == theirs


def test_after_a_restart_the_round_closes_without_its_last_call(store, capsys) -> None:
    handlers = agents(store, 2, max_nodes=2, last_call=600)
    try:
        assert sorted(join_all(handlers)) == [(0, 2), (1, 2)]  # round 0 closes full, at 2 of 2
        for handler in handlers:  # room for 4 from now on: only an early close ends a round before 600 s
            object.__setattr__(handler._settings, "max_nodes", 4)
        assert sorted(join_all(handlers)) == [(0, 2), (1, 2)]
        assert sorted(join_all(handlers)) == [(0, 2), (1, 2)]
    finally:
        leave(handlers)
    said = capsys.readouterr().err
    assert "rendezvous round 1 closes now: all 2 live nodes of the last round are back" in said
    assert "rendezvous round 2 closes now" in said


def test_a_dead_node_is_left_out_once_declared_dead_without_a_last_call(store) -> None:
    handlers = agents(store, 3, max_nodes=3, last_call=600)  # round 0: full at 3 nodes, no last call
    try:
        assert sorted(join_all(handlers)) == [(0, 3), (1, 3), (2, 3)]
        dead = handlers.pop()
        dead._stop_heartbeats()  # its agent is gone: keep-alives stop, it never leaves the round
        assert sorted(join_all(handlers)) == [(0, 2), (1, 2)]  # after about 3 s of missed keep-alives
    finally:
        leave(handlers)


def test_a_node_asking_to_join_is_in_the_next_round(store) -> None:
    first = agents(store, 2, max_nodes=4, last_call=1)
    newcomer, = agents(store, 1, max_nodes=4, last_call=1)
    try:
        assert sorted(join_all(first)) == [(0, 2), (1, 2)]
        with ThreadPoolExecutor(1) as pool:
            late = pool.submit(newcomer.next_rendezvous)  # waits in the wait list of the next round
            while first[0].num_nodes_waiting() == 0:
                threading.Event().wait(0.05)
            worlds = join_all(first)  # the agents restart for it, as torch's monitor does
            assert late.result(JOIN_TIMEOUT).world_size == 3
        assert [w for _, w in worlds] == [3, 3]
    finally:
        leave([*first, newcomer])


def test_a_node_that_joins_the_wait_list_is_seen_at_the_next_look_not_a_cached_second_later(store) -> None:
    """After a round completed, a node that comes back (its worker failed) waits for the next round;
    the other agents ask `num_nodes_waiting` at every look at their workers. torch serves it from a state
    cached for 1 s (here: for an hour); once the change was announced it is read afresh."""
    first, second, third = agents(store, 3, max_nodes=3, last_call=1)
    try:
        join_all([first, second])  # a round of two of at most three: it closes at its last call
        assert first.num_nodes_waiting() == 0  # read now, then cached
        first._state_holder._cache_duration = 3600  # the cache alone would answer 0 from here on,
        first._stop_heartbeats()  # and no keep-alive of its own reads the state meanwhile
        threading.Thread(target=third.next_rendezvous, daemon=True).start()  # a completed round: the wait list
        deadline = time.monotonic() + JOIN_TIMEOUT
        while first.num_nodes_waiting() == 0:
            assert time.monotonic() < deadline, "the waiting node was never seen"
            time.sleep(0.05)
    finally:
        leave([first, second, third])
