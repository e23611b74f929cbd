"""The simulator's rendezvous paths: N agents' handlers (one per node, each a thread) on one store.

Three handlers, side by side, each as the agent gets it from torch's registry:

- `c10d-stock`: torch's own c10d handler (torch's backend, torch's executor), nothing of ours;
- `c10d`: torchrevive-run's `c10d-sealed` (elastic._agent.rendezvous.handlers, registered as the launcher
  registers it): the state guarded, the store sealed, quick rounds, heartbeats in sealed keys, the worker
  store's port (worker_port), and at each of the agent's looks the notice board
  (notice_board.StoreBoard.read_new) besides torch's own look;
- `etcd-v3`: torchrevive-run's etcd-v3 handler (the same factory), its heartbeats on leases.

The settings are torchrevive-run's recovery defaults for all three (keep-alive every 1 s, a node dead
after 3 missed, a 2 s last call), min nodes N - 1, max N. Per path the phases are: `first` (every node
joins the first round), `steady` (`STEADY_SECONDS` of the agents' looks every `LOOK_SECONDS`, torch's
heartbeats running: operations per node per second), `lost` (one node dies; the others join the next
round: torch's agent does so after its workers failed).

Counting: each node's store client is a `CountingStore` (c10d: torch's `create_backend`, and c10d-sealed's
`c10d_store.create_store`, are replaced in the simulator's own child process, the one place they are, by
ones that connect to the served store), and
each etcd client's stubs count (`EtcdClient` replaced in that process by a subclass whose stubs count).
Operations made on a heartbeat thread (torch's keep-alive timer, the etcd lease's and presence's
threads) are also counted apart, as `heartbeat` operations.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from scale_count import CountingStore, Tally, count_etcd
from scale_model import Row, once
from scale_sim import MEMORY_DIR, Phase, Slice, connect, serve_store, spread

STEADY_SECONDS = 5.0
LOOK_SECONDS = 0.1
"""torch's agent looks at its workers every --monitor-interval (0.1 s): each look asks the handler how
many nodes wait (num_nodes_waiting); torchrevive-run's also reads the notice board."""
CONF = {"last_call_timeout": "2", "keep_alive_interval": "1", "keep_alive_max_attempt": "3", "join_timeout": "900",
        "read_timeout": "120", "heartbeat_timeout": "60", "close_timeout": "60"}
KINDS = {"rdzv-c10d-stock": "c10d-stock", "rdzv-c10d": "c10d", "rdzv-etcd-v3": "etcd-v3"}
ETCD_PATHS = {"rdzv-etcd-v3"}

_local = threading.local()


def _tally() -> Tally:
    return _local.tally


def install(kind: str, store_port: int | None) -> None:
    """Make this process's torch registry hand out `kind`'s handlers, on counted clients."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    if kind in ("c10d", "etcd-v3"):
        from elastic._agent.rendezvous import handlers, worker_port

        handlers.register()  # as torchrevive-run's launcher does
        worker_port.install()
    if kind == "c10d-stock":
        def create_backend(params: Any) -> tuple[Any, Any]:
            store = CountingStore(connect(store_port), _tally())
            _local.keep = store  # a Store written in Python lives as long as its Python object
            return c10d_rendezvous_backend.C10dRendezvousBackend(store, params.run_id), store

        c10d_rendezvous_backend.create_backend = create_backend  # the simulator's child process only
    if kind == "c10d":
        from elastic._agent.rendezvous import c10d_store

        def create_store(params: Any) -> Any:
            return CountingStore(connect(store_port), _tally())  # (the sealed stores on it keep it alive)

        c10d_store.create_store = create_store  # the simulator's child process only
    if kind == "etcd-v3":
        from elastic._agent.rendezvous import etcd, etcd_client, etcd_liveness

        class CountedClient(etcd_client.EtcdClient):
            def __init__(self, options: Any) -> None:
                super().__init__(options)
                count_etcd(self, _local.tally)
                _local.clients.append(self)  # a node that dies stops every client of its own

        etcd.EtcdClient = CountedClient  # the simulator's child process only (and below)
        if hasattr(etcd_liveness, "EtcdClient"):
            etcd_liveness.EtcdClient = CountedClient


def node(sl: Slice, rank: int) -> None:
    """One agent: its handler through the first round, the steady state and a round after a lost node."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

    kind = KINDS[sl.path]
    _local.tally, _local.clients = sl.tally(rank), []
    with sl._lock:
        if not sl.shared.get("installed"):
            install(kind, sl.store_port)
            sl.shared["installed"] = True
    endpoint = sl.etcd if kind == "etcd-v3" else f"127.0.0.1:{sl.store_port}"
    backend = {"c10d-stock": "c10d", "c10d": "c10d-sealed", "etcd-v3": "etcd-v3"}[kind]
    params = RendezvousParameters(backend=backend, endpoint=endpoint, run_id="sim",
                                  min_nodes=sl.n - 1, max_nodes=sl.n, **CONF)
    handler = registry.get_rendezvous_handler(params)
    board = _board(handler) if kind == "c10d" else None
    beats = [0]
    keep_alive = handler._keep_alive

    def counted_keep_alive() -> None:
        beats[0] += 1
        keep_alive()

    handler._keep_alive = counted_keep_alive  # torch's timer calls it through the instance
    lost = sl.n // 2
    for phase in ("first", "steady", "lost"):
        sl.barrier(f"rdzv-{phase}")
        if phase == "lost" and rank == lost:
            _die(handler)
            break
        started = time.monotonic()
        sl.begin(phase, rank)
        tally = sl.tally(rank)
        beats_before, heartbeat_before, won_before = beats[0], tally.heartbeat_snapshot(), tally.won
        if phase == "steady":
            looks = _look(handler, board)
            sl.note(phase, "looks", looks)
        else:
            handler.next_rendezvous()
            sl.note(phase, "closed_in", [round(time.monotonic() - started, 3)])
        sl.end(phase, rank)
        ops, nbytes = tally.heartbeat_snapshot()
        sl.note(phase, "won_writes", tally.won - won_before)
        sl.note(phase, "heartbeats", beats[0] - beats_before)
        sl.note(phase, "heartbeat_ops", ops - heartbeat_before[0])
        sl.note(phase, "heartbeat_bytes", nbytes - heartbeat_before[1])
    sl.barrier("rdzv-done")
    handler._stop_heartbeats()


def _board(handler: Any) -> Any:
    from elastic._agent.launcher.notice_board import StoreBoard

    return StoreBoard(handler._store, handler.get_run_id(), changes=handler.changes)


def _look(handler: Any, board: Any) -> int:
    """The agent's looks for `STEADY_SECONDS`: how many it took."""
    looks, deadline = 0, time.monotonic() + STEADY_SECONDS
    next_look = time.monotonic()
    while time.monotonic() < deadline:
        handler.num_nodes_waiting()
        if board is not None:
            board.read_new()
        looks += 1
        next_look += LOOK_SECONDS
        time.sleep(max(0.0, next_look - time.monotonic()))
    return looks


def _die(handler: Any) -> None:
    """A node lost: its heartbeats stop, nothing of it says goodbye (its etcd leases run out)."""
    handler._stop_heartbeats()
    for client in _local.clients:
        client._closed.set()  # no request, no lease keep-alive from here on: its leases expire


def run_rdzv(path: str, n: int, *, procs: int, timeout: float) -> dict[str, Phase]:
    """One rendezvous path at `n` nodes: its store (a TCPStore here, or an etcd member) and its children."""
    control = serve_store()
    if path in ETCD_PATHS:
        from elastic.chaos.etcd import EtcdServer

        with tempfile.TemporaryDirectory(prefix="scale-etcd-", dir=MEMORY_DIR) as directory:
            server = EtcdServer(Path(directory) / "data")
            server.start()
            try:
                return spread(path, n, procs=procs, store_port=None, control_port=control.port,
                              etcd=server.endpoint, params={}, timeout=timeout)
            finally:
                server.stop()
    store = serve_store()
    return spread(path, n, procs=procs, store_port=store.port, control_port=control.port, etcd=None, params={},
                  timeout=timeout)


RANK_BODIES = {path: node for path in KINDS}
CYCLES = 20


def write_cycle(kind: str, n: int) -> dict[str, float]:
    """One agent's write of the rendezvous state of `n` nodes, alone (no contention): the seconds of a
    read and a compare-and-set through torchrevive-run's guarded backend (the state pickled, sealed, sent,
    admitted, unpickled), and the state's bytes. The round's critical path is its winning writes one after
    another: `projected_round` multiplies them."""
    import pickle
    from datetime import datetime, timezone

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    from elastic._agent.rendezvous.state_guard import StateGuard
    from elastic._shared.storage.peer_auth import PeerKey

    state = _RendezvousState()
    now = datetime.now(timezone.utc)
    for rank in range(n):
        node = _NodeDesc(f"node{rank:05d}.cluster.example.com", 10000 + rank, 0)
        state.participants[node] = rank
        state.last_heartbeats[node] = now
    state.complete, state.round = True, 7
    guard = StateGuard.for_run("sim", PeerKey(b"s" * 32))
    control = serve_store()
    with tempfile.TemporaryDirectory(prefix="scale-cycle-", dir=MEMORY_DIR) as directory:
        backend, close = _backend(kind, guard, control, Path(directory))
        try:
            token = None
            started = time.perf_counter()
            for _ in range(CYCLES):
                current = backend.get_state()
                token = current[1] if current is not None else token
                written = backend.set_state(pickle.dumps(state), token)
                assert written is not None and written[2], "a lone writer lost its compare-and-set"
                token = written[1]
                pickle.loads(written[0])
            seconds = (time.perf_counter() - started) / CYCLES
        finally:
            close()
    return {"seconds": seconds, "state_bytes": float(len(pickle.dumps(state)))}


def _backend(kind: str, guard: Any, control: Any, directory: Path) -> tuple[Any, Any]:
    if kind == "etcd-v3":
        from torch.distributed.elastic.rendezvous.api import RendezvousParameters

        from elastic._agent.rendezvous.etcd import EtcdRendezvousBackend
        from elastic._agent.rendezvous.etcd_client import EtcdClient
        from elastic._agent.rendezvous.etcd_options import EtcdOptions
        from elastic.chaos.etcd import EtcdServer

        server = EtcdServer(directory / "data")
        server.start()
        client = EtcdClient(EtcdOptions.from_params(RendezvousParameters("etcd-v3", server.endpoint, "sim", 1, 1)))

        def close() -> None:
            client.close()
            server.stop()

        return EtcdRendezvousBackend(client, b"/torchrevive/sim/rdzv/state", guard), close
    from elastic._agent.rendezvous.guarded_c10d import C10dStateBackend

    return C10dStateBackend(connect(control.port), "sim", guard), lambda: None


def projected_round(cycle_seconds: float, won_per_node: float, n: int, dead_after: float) -> float:
    """A round after a lost node on a real cluster (an agent's own CPU each): its winning writes one after
    another, each a lone write cycle, after the dead node's heartbeat ran out."""
    return dead_after + won_per_node * n * cycle_seconds


def _label(kind: str) -> str:
    return {"c10d-stock": "torch's stock c10d", "c10d": "c10d (torchrevive-run)", "etcd-v3": "etcd-v3"}[kind]


ROWS = [row for path, kind in KINDS.items() for row in (
    Row(f"rendezvous, first round: {_label(kind)}", path, "first", once),
    Row(f"rendezvous, after a lost node: {_label(kind)}", path, "lost", once),
    Row(f"steady, per node per second: {_label(kind)}", path, "steady", lambda phase, n: STEADY_SECONDS),
)]


PROJECTED = (1024, 4096)


def projection_section(table: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Print the modelled round after a lost node at `PROJECTED` nodes (see `projected_round`): the winning
    state writes a node makes in such a round as simulated, a lone write cycle measured at that size here,
    torch's dead-after time. Modelled, not simulated: this machine's two shared cores cannot run a thousand
    agents' Python at once; each agent has its own CPU in a job."""
    won = {}
    for by_n in table.values():
        figures = by_n[max(by_n)]
        if figures.get("phase") == "lost" and figures.get("won_writes_per_rank"):
            won[figures["path"]] = figures["won_writes_per_rank"]
    per_node = won.get("rdzv-c10d")
    if per_node is None:
        return {}
    dead_after = float(CONF["keep_alive_interval"]) * float(CONF["keep_alive_max_attempt"])
    found: dict[str, Any] = {"won_writes_per_node": per_node, "dead_after_seconds": dead_after, "rounds": {}}
    print()
    print(f"a round after a lost node, modelled: {per_node:.2f} winning state writes a node (simulated, c10d), "
          f"one after another, each a lone write cycle measured here at that size, after {dead_after:g} s of dead-after:")
    for kind in ("c10d", "etcd-v3"):
        for n in PROJECTED:
            cycle = write_cycle(kind, n)
            seconds = projected_round(cycle["seconds"], per_node, n, dead_after)
            found["rounds"].setdefault(kind, {})[str(n)] = {"seconds": round(seconds, 1), "cycle_s": round(cycle["seconds"], 5),
                                                            "state_bytes": int(cycle["state_bytes"])}
            print(f"  {kind:8} {n:>5} nodes: {seconds:6.1f} s (a write cycle {cycle['seconds'] * 1000:.1f} ms, "
                  f"state {cycle['state_bytes'] / 1024:.0f} KiB)")
    return found
