"""A node's heartbeat is a key of its own (elastic._agent.rendezvous.liveness: etcd-v3's lease per node, c10d's
key per node, each beat sealed like the agents' store's values), not torch's whole state rewritten every
interval by every node: the factory's handlers (handlers.build), as threads, on an in-memory backend that
guards and counts what is written, at two sizes; who torch declares dead follows the nodes' keys; a newcomer
takes a live launch whose state's record of the beats aged; and an agent's look between rounds reads no
state while nothing changed."""

from __future__ import annotations

import base64
import math
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, _RendezvousJoinOp

from elastic._agent.rendezvous import change_signal, quick_rounds
from elastic._agent.rendezvous import handlers as factory
from elastic._agent.rendezvous.etcd_liveness import read_leases
from elastic._agent.rendezvous.liveness import Heartbeats, dead_after_seconds, node_key, stamp
from elastic._agent.rendezvous.state_guard import StateGuard
from elastic._agent.rendezvous.store_liveness import key_heartbeats
from elastic._shared.storage.peer_auth import PeerKey

ALIVE = b"/run/alive/"
KEY = PeerKey(b"k" * 32)


class Cell:
    """The state as a store holds it: compare-and-set on a counter; the bytes written, by the thread that wrote."""

    def __init__(self) -> None:
        self.blob: bytes | None = None
        self.token = 0
        self.lock = threading.Lock()
        self.written: dict[str, int] = {}


class MemoryBackend(RendezvousBackend):
    """One agent's backend on `cell`, its state sealed and admitted by its own guard (as guarded_c10d's)."""

    def __init__(self, cell: Cell, key: PeerKey | None = KEY) -> None:
        self.cell = cell
        self.guard = StateGuard.for_run("run", key)
        self.reads = 0

    @property
    def name(self) -> str:
        return "memory"

    def get_state(self) -> tuple[bytes, Any] | None:
        self.reads += 1
        with self.cell.lock:
            blob, token = self.cell.blob, self.cell.token
        return None if blob is None else (self.guard.admit(blob), token)

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        sealed, seq = self.guard.sealed(state)
        with self.cell.lock:
            kind = "heartbeat" if threading.current_thread().name.startswith("RendezvousKeepAliveTimer") else "other"
            self.cell.written[kind] = self.cell.written.get(kind, 0) + len(sealed)
            if (self.cell.blob is None and token is None) or token == self.cell.token:
                self.cell.blob, self.cell.token = sealed, self.cell.token + 1
                won, token = True, self.cell.token
            else:
                blob, token, won = self.cell.blob, self.cell.token, False
        if won:
            self.guard.won(state, seq)
            return state, token, True
        return None if blob is None else (self.guard.admit(blob), token, False)


class Leases:
    """What etcd holds under `alive/`: each node whose lease is kept alive, and its value made as its
    presence makes it (rewritten often: made at each read); `range` as EtcdClient answers it."""

    def __init__(self) -> None:
        self.values: dict[bytes, Callable[[], bytes]] = {}
        self.reads = 0

    def range(self, key: bytes, *, prefix: bool, what: str) -> dict[str, Any]:
        assert key == ALIVE and prefix
        self.reads += 1
        return {"kvs": [{"key": base64.b64encode(ALIVE + name).decode(), "value": base64.b64encode(value()).decode()}
                        for name, value in sorted(self.values.items())]}


def params(size: int, **conf: str) -> RendezvousParameters:
    return RendezvousParameters("memory", "localhost:0", "run", size, size, keep_alive_interval=1,
                                keep_alive_max_attempt=3, last_call_timeout=1, join_timeout=60, **conf)


def lease_factory(leases: Leases) -> factory.MakeHeartbeats:
    """etcd-v3's heartbeats on `leases` (the presence's key, as etcd_liveness.lease_heartbeats makes it)."""

    def make(node: Any, settings: Any, sealed: Any, scope_of: Any) -> Heartbeats:
        name = node_key(node).encode()
        leases.values[name] = lambda: sealed.seal(ALIVE + name, stamp())  # entered before the node joins
        reader = read_leases(leases, ALIVE, sealed, scope_of, dead_after_seconds(settings))
        return Heartbeats(lambda: None, reader, fresh_for=settings.keep_alive_interval.total_seconds() / 2)

    return make


def make_handlers(size: int, cell: Cell, store: Any, *, beats: str, leases: Leases | None = None,
                  quick: bool = False) -> list[Any]:
    """`size` nodes' handlers from the factory; their heartbeats: "leases" (etcd-v3's), "keys" (c10d's, in
    `store`), or "torch" (the state rewritten)."""
    made, leases = [], leases if leases is not None else Leases()
    for _ in range(size):
        heartbeats = {"leases": lease_factory(leases), "keys": key_heartbeats, "torch": None}[beats]
        made.append(factory.build(params(size, quick_rounds="1" if quick else "0"), MemoryBackend(cell), store,
                                  KEY, watch=False, heartbeats=heartbeats))
    return made


def first_round(made: list[Any]) -> None:
    def join(handler: Any) -> None:  # the round's join, as next_rendezvous runs it (the worker store aside)
        handler._op_executor.run(_RendezvousJoinOp(), time.monotonic() + 60)
        handler.guard.fix()

    joined = [threading.Thread(target=join, args=(h,), daemon=True) for h in made]
    for thread in joined:
        thread.start()
    for thread in joined:
        thread.join(60)
    assert all(h._state_holder.state.complete for h in made)
    assert len({h.guard.launch for h in made}) == 1, "every agent took the same launch"


def handlers_through_a_round(size: int, cell: Cell, store: Any, **kwargs: Any) -> list[Any]:
    made = make_handlers(size, cell, store, **kwargs)
    first_round(made)
    return made


class CountingStore(dist.Store):
    """An in-process store whose writes' bytes are counted."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.written = dist.HashStore(), 0

    def set(self, key: str, value: Any) -> None:
        self.written += len(key) + len(value)
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.inner.multi_get(keys)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def clone(self) -> CountingStore:
        return self


def age_records(handler: Any, seconds: float) -> None:
    """This agent's copy of the state says every node last beat `seconds` ago."""
    for node in list(handler._state_holder.state.last_heartbeats):
        handler._state_holder.state.last_heartbeats[node] = datetime.now(timezone.utc) - timedelta(seconds=seconds)


@pytest.mark.parametrize("beats", ["leases", "keys", "torch"])
def test_a_heartbeat_writes_nothing_of_the_state_at_any_size(beats: str) -> None:
    per_beat, store_bytes = {}, {}
    for size in (4, 16):
        cell, store = Cell(), CountingStore()
        made = handlers_through_a_round(size, cell, store, beats=beats)
        cell.written.clear()
        store.written = 0
        for handler in made:  # each node's timer fires once (torch's heartbeat is due: 1 s have passed)
            age_records(handler, 1)
            beat = threading.Thread(target=handler._keep_alive, name="RendezvousKeepAliveTimer_sim")
            beat.start()
            beat.join(30)
        per_beat[size] = cell.written.get("heartbeat", 0) / size
        store_bytes[size] = store.written / size
    if beats != "torch":
        assert per_beat == {4: 0, 16: 0}, per_beat  # etcd: the lease's keep-alive is the beat, a few bytes
        assert store_bytes[4] == store_bytes[16] <= (200 if beats == "keys" else 0), store_bytes  # c10d: one key
    else:  # torch's own: the whole state, O(N) bytes a beat (and O(N^2) a round of beats)
        assert per_beat[16] > 2 * per_beat[4], per_beat  # 0.9 KB at 4 nodes, 2.3 KB at 16


def test_a_node_whose_lease_ran_out_is_declared_dead_and_a_leased_one_never_is() -> None:
    leases = Leases()
    made = handlers_through_a_round(3, Cell(), dist.HashStore(), beats="leases", leases=leases)
    holder = made[0]._state_holder
    nodes = [h._this_node for h in made]
    for node in nodes:
        holder._state.last_heartbeats[node] = datetime.now(timezone.utc) - timedelta(hours=1)  # only the leases speak
    del leases.values[node_key(nodes[2]).encode()]  # node 2 died: its lease expired, its key went with it
    holder._last_sync_time = -1
    made[0].heartbeats.read_at = -math.inf  # half a keep-alive interval later
    reads = leases.reads
    holder.sync()
    assert leases.reads == reads + 1, "one read of the keys per read of the state"
    assert holder._dead_nodes == [nodes[2]]
    assert set(holder.state.participants) == set(nodes[:2])
    assert dead_after_seconds(made[0]._settings) == 3


def test_a_node_whose_key_is_old_is_declared_dead_and_a_strangers_beat_does_not_keep_it_alive() -> None:
    store = dist.HashStore()
    made = handlers_through_a_round(3, Cell(), store, beats="keys")
    holder = made[0]._state_holder
    nodes = [h._this_node for h in made]
    for handler in made:
        handler._keep_alive()  # each node beats in the launch they all took
    holder._last_sync_time = -1
    made[0].heartbeats.read_at = -math.inf
    holder.sync()  # the newest state, then its record of every beat made an hour old
    age_records(made[0], 3600)
    holder.mark_dirty()
    assert holder.sync()
    assert holder._dead_nodes == [], "every node's own key says it beat just now"
    sealed = made[0]._store
    name = "torchrevive.rdzv.run.alive/"
    sealed.set(name + node_key(nodes[2]), f"{time.time() - 3600:.3f}")  # node 2 last beat an hour ago ...
    store.set(name + node_key(nodes[1]), f"{time.time():.3f}")  # ... a stranger writes node 1 a beat, unsealed
    holder._last_sync_time = -1
    made[0].heartbeats.read_at = -math.inf
    holder.sync()
    assert set(holder._dead_nodes) == {nodes[1], nodes[2]}, "an unsealed beat is no beat: the record stood"
    assert set(holder.state.participants) == {nodes[0]}


@pytest.mark.parametrize("beats", ["leases", "keys"])
def test_a_newcomer_takes_a_live_launch_whose_state_records_old_beats(beats: str) -> None:
    """A node's beats are in its key, so the state's record of them ages while the job trains: a node that
    joins later (a replacement, a scale-up) must still find the launch live (state_guard), or it would start
    a launch of its own and replace the job's state."""
    cell, store, leases = Cell(), dist.HashStore(), Leases()
    made = handlers_through_a_round(2, cell, store, beats=beats, leases=leases)
    launch = made[0].guard.launch
    for handler in made:
        handler._keep_alive()
    age_records(made[0], 3600)  # a membership write long ago was the last to record the beats
    made[0]._state_holder.mark_dirty()
    assert made[0]._state_holder.sync()
    newcomer = make_handlers(1, cell, store, beats=beats, leases=leases)[0]
    newcomer._state_holder.sync()
    assert newcomer.guard.refused == 0
    assert newcomer.guard.current_launch == launch, "the newcomer took the job's launch"
    stale = make_handlers(1, cell, store, beats=beats, leases=Leases())[0]  # its reader sees no lease at all
    if beats == "keys":
        for handler in made:  # the job's nodes beat last an hour ago (the job ended)
            handler._store.set("torchrevive.rdzv.run.alive/" + node_key(handler._this_node), f"{time.time() - 3600:.3f}")
    stale._state_holder.sync()
    assert stale.guard.refused == 1 and stale.guard.current_launch != launch, "an ended launch is never taken"


def test_an_agents_look_reads_no_state_while_no_membership_changed() -> None:
    """torch serves `num_nodes_waiting` from a copy at most 1 s old: every node read the whole state every
    second between failures. With quick rounds it reads the change counter only, until a change."""
    store = dist.HashStore()
    handler = handlers_through_a_round(1, Cell(), store, beats="keys", quick=True)[0]
    backend = handler._state_holder._backend
    handler.num_nodes_waiting()
    reads = backend.reads
    for _ in range(20):  # 20 looks, each more than torch's 1 s cache after the one before
        handler._state_holder._last_sync_time -= 2
        assert handler.num_nodes_waiting() == 0
    assert backend.reads == reads
    handler._signal.announce()  # a node asked to join, say
    handler.num_nodes_waiting()
    assert backend.reads == reads + 1


def test_a_lost_compare_and_set_waits_a_jittered_window_that_doubles_to_a_bound() -> None:
    """N nodes that lost to one write would all write again at once (torch 2.14's settings have no backoff)."""
    windows = [max(quick_rounds.cas_backoff(object(), lost) for _ in range(400)) for lost in (1, 2, 3, 4, 12)]
    assert windows[0] <= 0.002 and windows[1] <= 0.004 and windows[2] <= 0.008 and windows[3] <= 0.016
    assert 0.25 < windows[4] <= quick_rounds.CAS_BACKOFF_MAX_SECONDS, windows
    assert len({quick_rounds.cas_backoff(object(), 5) for _ in range(20)}) > 1, "jittered"
    torch_own = type("Settings", (), {"cas_backoff_max_seconds": 0.01})()
    assert all(quick_rounds.cas_backoff(torch_own, 30) <= 0.01 for _ in range(100))


def test_an_agents_look_reads_the_state_within_a_bound_even_when_no_change_was_announced(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A join whose announcement never landed (its node was partitioned while it counted) delays the others'
    restart by at most FULL_READ_EVERY_S (the handler factory), never for good (test_etcd_v3_partition's healed node once
    waited until its join timeout while the others trained on)."""
    store = dist.HashStore()
    handler = handlers_through_a_round(1, Cell(), store, beats="keys", quick=True)[0]
    backend = handler._state_holder._backend
    now = [1000.0]
    monkeypatch.setattr(factory.time, "monotonic", lambda: now[0])
    handler.num_nodes_waiting()
    reads = backend.reads
    now[0] += factory.FULL_READ_EVERY_S / 2
    handler.num_nodes_waiting()
    assert backend.reads == reads, "within the bound: the counter only"
    now[0] += factory.FULL_READ_EVERY_S
    handler.num_nodes_waiting()
    assert backend.reads == reads + 1, "past the bound: the whole state, announced or not"


class OpCountingStore(dist.Store):
    """An in-process store that counts every operation, its clones' too (a watcher's connection)."""

    def __init__(self, inner: Any = None, counts: list[int] | None = None) -> None:
        super().__init__()
        self.inner = inner if inner is not None else dist.HashStore()
        self.counts = counts if counts is not None else [0]

    def _op(self) -> None:
        self.counts[0] += 1

    def set(self, key: str, value: Any) -> None:
        self._op()
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._op()
        return self.inner.get(key)

    def check(self, keys: list[str]) -> bool:
        self._op()
        return self.inner.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._op()
        return self.inner.multi_get(keys)

    def add(self, key: str, amount: int) -> int:
        self._op()
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._op()
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._op()
        self.counts.append(1)  # (one more wait begun: counts[1:])
        self.inner.wait(keys, timeout) if timeout is not None else self.inner.wait(keys)

    def delete_key(self, key: str) -> bool:
        self._op()
        return self.inner.delete_key(key)

    def clone(self) -> OpCountingStore:
        return OpCountingStore(self.inner, self.counts)


@pytest.mark.parametrize("size", [2, 8])
def test_a_quiet_jobs_looks_cost_no_store_operation_and_a_change_costs_each_agent_a_few(
        size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between rounds each agent looks every 0.1 s (`num_nodes_waiting`, the notice board): 31 operations a node
    a second, 30 of them these looks (benchmarks/scale.py). The change signal's watcher blocks in the store
    instead; a look reads what it saw. A post on the board is announced on it and read once by every agent."""
    from elastic._agent.launcher.notice_board import Entry, StoreBoard

    monkeypatch.setattr(change_signal, "RESYNC_SECONDS", 3600.0)  # the bound on a look's own reads: not here
    store = OpCountingStore()
    made = handlers_through_a_round(size, Cell(), store, beats="keys", quick=True)
    boards = [StoreBoard(h._store, "run", {}, changes=h.changes) for h in made]
    for handler, board in zip(made, boards):  # the first look: the counter read, the watcher started
        handler.num_nodes_waiting()
        board.read_new()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # until every watcher waits in the store and has caught up (a change of
        settled = store.counts[0]        # the first round it woke for makes each board read its empty slot once)
        time.sleep(0.05)
        for handler, board in zip(made, boards):
            handler.num_nodes_waiting()
            board.read_new()
        if len(store.counts) - 1 >= size and store.counts[0] == settled:
            break
    before = store.counts[0]
    for _ in range(20):
        for handler, board in zip(made, boards):
            handler._state_holder._last_sync_time -= 2  # torch's own 1 s cache would have read the state
            assert handler.num_nodes_waiting() == 0
            assert board.read_new() == []
    assert store.counts[0] == before, "a look costs no store operation while nothing changes"

    boards[0].post(Entry("failure", "failure: worker rank 1 ...", time.time(), 7, size, "node-b", {}))
    deadline = time.monotonic() + 10
    seen = [False] * size
    while not all(seen) and time.monotonic() < deadline:
        for i, board in enumerate(boards):
            seen[i] = seen[i] or [entry.line for _, entry in board.read_new()] == ["failure: worker rank 1 ..."]
        time.sleep(0.01)
    assert all(seen), "every agent read the post after its announcement"
    per_agent = (store.counts[0] - before) / size
    assert per_agent <= 12, f"{per_agent:.1f} operations an agent for one post"  # flat in the job's size


def test_a_look_never_brings_back_the_change_counter_after_the_runs_keys_were_removed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The last agent of an etcd-v3 run removes the run's keys as it leaves; a look (or the watcher) that read
    the counter by adding 0 wrote it back, and the finished run left a key behind (test_relaunch)."""
    from elastic._shared.storage.sealed_store import SealedStore

    monkeypatch.setattr(change_signal, "RESYNC_SECONDS", 0.0)  # every look reads the counter itself
    inner = dist.HashStore()
    signal = change_signal.ChangeSignal(SealedStore(inner, KEY, "scope"), "run", watch=False)
    signal.announce()
    assert signal.latest() == 1
    inner.delete_key("torchrevive.rdzv.run.changes")
    assert signal.latest() == 1  # what it saw last stands
    time.sleep(0.1)  # (the watcher's read too)
    assert not inner.check(["torchrevive.rdzv.run.changes"])


def test_the_change_watcher_is_woken_and_joined_at_exit_and_the_other_watchers_go_on() -> None:
    """The watcher blocks in a C++ store wait for days. Left blocked at exit, its wait could return while the
    interpreter finalizes and abort the process (a Slurm replacement agent whose job had succeeded exited
    134: "terminate called without an active exception"). It is a library thread: the exit wakes it (the key
    it waits on) and joins it. Another agent's watcher, woken by that key, still sees the next change."""
    from elastic._shared.common import threads
    from elastic._shared.storage.sealed_store import SealedStore

    inner = dist.HashStore()
    leaving, staying = (change_signal.ChangeSignal(SealedStore(inner, KEY, "scope"), "run", watch=False) for _ in "ab")
    assert leaving.latest() == staying.latest() == 0
    watcher = leaving._watcher
    (entry,) = [e for e in threads._entries if e.thread is watcher]  # registered: the exit stops it
    deadline = time.monotonic() + 10
    while leaving._waking is None and time.monotonic() < deadline:  # (in its wait)
        time.sleep(0.01)
    entry.stop()  # what the exit does (threads.stop_all), before it joins
    watcher.join(10)
    assert not watcher.is_alive()
    leaving.announce()  # (another agent's change)
    while staying.latest() != 1 and time.monotonic() < deadline + 10:
        time.sleep(0.05)
    assert staying.latest() == 1 and staying._watcher.is_alive()
