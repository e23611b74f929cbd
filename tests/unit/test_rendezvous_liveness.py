"""A node's heartbeat is a key of its own (elastic._agent.rendezvous.liveness: etcd-v3's lease per node, c10d's
sealed key per node), not torch's whole state rewritten every interval by every node: torch's real handlers,
as threads, on an in-memory backend that counts what is written, at two sizes; who torch declares dead
follows the nodes' keys; and an agent's look between rounds reads no state while nothing changed."""

from __future__ import annotations

import base64
import math
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, _RendezvousJoinOp, create_handler

from elastic._agent.rendezvous import quick_rounds
from elastic._agent.rendezvous.etcd_liveness import lease_heartbeats
from elastic._agent.rendezvous.liveness import dead_after_seconds, node_key
from elastic._agent.rendezvous.store_liveness import key_heartbeats
from elastic._shared.storage.peer_auth import PeerKey
from elastic._shared.storage.store_records import Records

ALIVE = b"/run/alive/"


class MemoryBackend(RendezvousBackend):
    """The state in memory, compare-and-set on a counter; the bytes written, by the thread that wrote them."""

    def __init__(self) -> None:
        self.state: bytes | None = None
        self.token = 0
        self.lock = threading.Lock()
        self.written: dict[str, int] = {}

    @property
    def name(self) -> str:
        return "memory"

    def get_state(self) -> tuple[bytes, Any] | None:
        with self.lock:
            return None if self.state is None else (self.state, self.token)

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        with self.lock:
            kind = "heartbeat" if threading.current_thread().name.startswith("RendezvousKeepAliveTimer") else "other"
            self.written[kind] = self.written.get(kind, 0) + len(state)
            if (self.state is None and token is None) or token == self.token:
                self.state, self.token = state, self.token + 1
                return state, self.token, True
            return None if self.state is None else (self.state, self.token, False)


class Leases:
    """What etcd holds under `alive/`: the nodes whose lease is kept alive; `range` as EtcdClient answers it."""

    def __init__(self) -> None:
        self.names: set[bytes] = set()
        self.reads = 0

    def range(self, key: bytes, *, prefix: bool, keys_only: bool, what: str) -> dict[str, Any]:
        assert key == ALIVE and prefix and keys_only
        self.reads += 1
        return {"kvs": [{"key": base64.b64encode(ALIVE + name).decode()} for name in sorted(self.names)]}


KEY = PeerKey(b"k" * 32)


def params(size: int) -> RendezvousParameters:
    return RendezvousParameters("memory", "localhost:0", "run", size, size, keep_alive_interval=1,
                                keep_alive_max_attempt=3, last_call_timeout=1, join_timeout=60)


def handlers(size: int, backend: MemoryBackend, leases: Leases, *, beats: str, store: Any = None) -> list[Any]:
    """`size` nodes' handlers through a first round; their heartbeats: "leases" (etcd-v3's), "keys"
    (c10d's, in `store`), or "torch" (the state rewritten)."""
    store = store if store is not None else dist.HashStore()
    made = []
    for _ in range(size):
        handler = create_handler(store, backend, params(size))
        if beats == "leases":
            leases.names.add(node_key(handler._this_node).encode())  # its AgentPresence entered before it joins
            lease_heartbeats(handler, leases, ALIVE)
        elif beats == "keys":
            key_heartbeats(handler, store, "run", KEY)
        made.append(handler)
    def join(handler: Any) -> None:  # the round's join, as next_rendezvous runs it (the worker store aside)
        handler._op_executor.run(_RendezvousJoinOp(), time.monotonic() + 60)

    joined = [threading.Thread(target=join, args=(h,), daemon=True) for h in made]
    for thread in joined:
        thread.start()
    for thread in joined:
        thread.join(60)
    assert all(h._state_holder.state.complete for h in made)
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


@pytest.mark.parametrize("beats", ["leases", "keys", "torch"])
def test_a_heartbeat_writes_nothing_of_the_state_at_any_size(beats: str) -> None:
    per_beat, store_bytes = {}, {}
    for size in (4, 16):
        backend, leases, store = MemoryBackend(), Leases(), CountingStore()
        made = handlers(size, backend, leases, beats=beats, store=store)
        backend.written.clear()
        store.written = 0
        for handler in made:  # each node's timer fires once (torch's heartbeat is due: 1 s have passed)
            for node in list(handler._state_holder.state.last_heartbeats):
                handler._state_holder.state.last_heartbeats[node] -= timedelta(seconds=1)
            beat = threading.Thread(target=handler._keep_alive, name="RendezvousKeepAliveTimer_sim")
            beat.start()
            beat.join(30)
        per_beat[size] = backend.written.get("heartbeat", 0) / size
        store_bytes[size] = store.written / size
    if beats != "torch":
        assert per_beat == {4: 0, 16: 0}, per_beat  # etcd: the lease's keep-alive is the beat, a few bytes
        assert store_bytes[4] == store_bytes[16] <= (200 if beats == "keys" else 0), store_bytes  # c10d: one key
    else:  # torch's own: the whole state, O(N) bytes a beat (and O(N^2) a round of beats)
        assert per_beat[16] > 2 * per_beat[4], per_beat  # 0.9 KB at 4 nodes, 2.3 KB at 16


def test_a_node_whose_lease_ran_out_is_declared_dead_and_a_leased_one_never_is() -> None:
    backend, leases = MemoryBackend(), Leases()
    made = handlers(3, backend, leases, beats="leases")
    holder = made[0]._state_holder
    nodes = [h._this_node for h in made]
    old = datetime.now(timezone.utc) - timedelta(hours=1)
    for node in nodes:
        holder._state.last_heartbeats[node] = old  # the state's record is old: only the leases speak
    leases.names.discard(node_key(nodes[2]).encode())  # node 2 died: its lease expired, its key went with it
    holder._last_sync_time = -1
    holder.beats_read["at"] = -math.inf  # half a keep-alive interval later
    reads = leases.reads
    holder.sync()
    assert leases.reads == reads + 1, "one read of the keys per read of the state"
    assert holder._dead_nodes == [nodes[2]]
    assert set(holder.state.participants) == set(nodes[:2])
    assert dead_after_seconds(made[0]) == 3


def test_a_node_whose_key_is_old_is_declared_dead_and_a_strangers_beat_does_not_keep_it_alive() -> None:
    backend, store = MemoryBackend(), dist.HashStore()
    made = handlers(3, backend, Leases(), beats="keys", store=store)
    holder = made[0]._state_holder
    nodes = [h._this_node for h in made]
    holder._last_sync_time = -1
    holder.beats_read["at"] = -math.inf
    holder.sync()  # the newest state, then its record of every beat made an hour old
    for node in nodes:
        holder._state.last_heartbeats[node] = datetime.now(timezone.utc) - timedelta(hours=1)
    holder.mark_dirty()
    assert holder.sync()
    assert holder._dead_nodes == [], "every node's own key says it beat just now"
    scope = "torchrevive.rdzv.run.alive"
    records = Records(dist.PrefixStore(scope, store), key=KEY, scope=scope)
    records.set(node_key(nodes[2]), f"{time.time() - 3600:.3f}")  # node 2 last beat an hour ago ...
    records.store.set(node_key(nodes[1]), f"{time.time():.3f}")  # ... a stranger writes node 1 a beat, unsealed
    holder._last_sync_time = -1
    holder.beats_read["at"] = -math.inf
    holder.sync()
    assert set(holder._dead_nodes) == {nodes[1], nodes[2]}, "an unsealed beat is no beat: the record stood"
    assert set(holder.state.participants) == {nodes[0]}


def test_an_agents_look_reads_no_state_while_no_membership_changed() -> None:
    """torch serves `num_nodes_waiting` from a copy at most 1 s old: every node read the whole state every
    second between failures. With quick rounds it reads the change counter only, until a change."""
    backend, store = MemoryBackend(), dist.HashStore()
    handler = quick_rounds.quicken(handlers(1, backend, Leases(), beats="keys", store=store)[0], params(1))
    reads = []
    get_state = backend.get_state

    def counted() -> Any:
        reads.append(1)
        return get_state()

    backend.get_state = counted
    handler.num_nodes_waiting()
    reads.clear()
    for _ in range(20):  # 20 looks, each more than torch's 1 s cache after the one before
        handler._state_holder._last_sync_time -= 2
        assert handler.num_nodes_waiting() == 0
    assert reads == []
    quick_rounds.ChangeSignal(store, "run", watch=True).announce()  # a node asked to join, say
    handler.num_nodes_waiting()
    assert reads == [1]


def test_a_lost_compare_and_set_waits_a_jittered_window_that_doubles_to_a_bound() -> None:
    """N nodes that lost to one write would all write again at once (torch 2.14's settings have no backoff)."""
    windows = [max(quick_rounds.cas_backoff(object(), lost) for _ in range(400)) for lost in (1, 2, 3, 4, 12)]
    assert windows[0] <= 0.002 and windows[1] <= 0.004 and windows[2] <= 0.008 and windows[3] <= 0.016
    assert 0.25 < windows[4] <= quick_rounds.CAS_BACKOFF_MAX_SECONDS, windows
    assert len({quick_rounds.cas_backoff(object(), 5) for _ in range(20)}) > 1, "jittered"
    torch_own = type("Settings", (), {"cas_backoff_max_seconds": 0.01})()
    assert all(quick_rounds.cas_backoff(torch_own, 30) <= 0.01 for _ in range(100))
