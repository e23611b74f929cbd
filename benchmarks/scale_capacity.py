"""The simulator's capacity model: the store load of a job of 1k, 4k and 16k ranks, from the measured figures.

What one store serves is measured here too (`calibrate`: client threads doing small reads and writes for a
few seconds against a TCPStore and an etcd started for it), on the machine of the run: the model says
which store a job needs by comparing its load with that, and prints it as a short section (`print_section`)
and as the markdown docs/results.md takes (`markdown`).

The load of a job of R ranks on N = R / `RANKS_PER_NODE` nodes (scale_model.capacity), per store:
- between failures: each agent's operations per second (its heartbeats and its looks: the rows
  "steady, per node per second"), times N; workers make no store operation per step (the hang's idle
  look and the vote are measured at 0);
- a failure (a node lost, every agent in a new round): each agent's operations for the round after a lost
  node and for reading the failure's notice, times N; with train-on, each worker's operations for the
  shrink and the replacements' join instead of the round, times R. Its rate is that over `FAILURE_SECONDS`
  (the round's target).
Per-rank figures are taken at the largest N measured (flat where the table says so; the model says
when a figure it uses grew with N).
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import scale_model
from scale_sim import MEMORY_DIR

RANKS = (1024, 4096, 16384)
RANKS_PER_NODE = 8
FAILURE_SECONDS = 10.0
CALIBRATION_SECONDS = 3.0
CALIBRATION_THREADS = 16


def _largest(table: dict[str, dict[int, dict[str, Any]]], path: str, phase: str) -> tuple[float, float, bool] | None:
    """(ops per rank, aggregator ops, grew with N) of `path`'s `phase` at the largest N measured."""
    for by_n in table.values():
        largest = max(by_n)
        figures = by_n[largest]
        if figures.get("path") == path and figures.get("phase") == phase:
            grew = scale_model.growth({n: f["ops_per_rank"] for n, f in by_n.items()}) != "constant"
            return figures["ops_per_rank"], figures["aggregator_ops"] or 0.0, grew
    return None


def loads(table: dict[str, dict[int, dict[str, Any]]]) -> dict[str, list[scale_model.Load]]:
    """Each store's loads at `RANKS` (c10d under torchrevive-run, etcd-v3; restart and train-on failures)."""
    notice = _largest(table, "notice-board", "read")
    views = [_largest(table, "views", phase) for phase in ("leave", "join")]
    found: dict[str, list[scale_model.Load]] = {}
    for store, path in (("c10d", "rdzv-c10d"), ("etcd-v3", "rdzv-etcd-v3")):
        steady, lost = _largest(table, path, "steady"), _largest(table, path, "lost")
        if steady is None or lost is None:
            continue
        per_node = lost[0] + (notice[0] if notice and store == "c10d" else 0.0)
        found[store] = [scale_model.capacity(
            ranks, ranks_per_node=RANKS_PER_NODE, per_rank_failure_ops=0.0, per_node_failure_ops=per_node,
            failure_seconds=FAILURE_SECONDS, per_node_steady_ops_per_s=steady[0]) for ranks in RANKS]
    if all(v is not None for v in views) and notice is not None:
        per_rank = sum(v[0] for v in views if v is not None)
        aggregators = sum(v[1] for v in views if v is not None)
        steady = _largest(table, "rdzv-c10d", "steady")
        found["c10d, train-on"] = [scale_model.capacity(
            ranks, ranks_per_node=RANKS_PER_NODE, per_rank_failure_ops=per_rank, per_node_failure_ops=notice[0],
            failure_seconds=FAILURE_SECONDS, per_node_steady_ops_per_s=steady[0] if steady else 0.0,
            aggregator_ops=aggregators) for ranks in RANKS]
    return found


def calibrate(seconds: float = CALIBRATION_SECONDS) -> dict[str, float]:
    """Small operations per second one TCPStore (libuv) and one etcd member serve here, from
    `CALIBRATION_THREADS` client threads (half writing, half reading)."""
    from scale_sim import connect, serve_store

    served: dict[str, float] = {}
    server = serve_store()
    served["tcpstore"] = _hammer(lambda: connect(server.port), lambda c, i: c.set(f"k{i % 64}", b"v" * 32),
                                 lambda c, i: c.get(f"k{i % 64}"), seconds)
    try:
        from elastic._agent.rendezvous.etcd_client import EtcdClient
        from elastic._agent.rendezvous.etcd_options import EtcdOptions
        from elastic.chaos.etcd import EtcdServer
    except ImportError:
        return served
    with tempfile.TemporaryDirectory(prefix="scale-calibrate-", dir=MEMORY_DIR) as directory:
        etcd = EtcdServer(Path(directory) / "data")
        etcd.start()
        try:
            from torch.distributed.elastic.rendezvous.api import RendezvousParameters

            options = EtcdOptions.from_params(RendezvousParameters("etcd-v3", etcd.endpoint, "calibrate", 1, 1))
            served["etcd"] = _hammer(
                lambda: EtcdClient(options),
                lambda c, i: c.txn([], [c.put_op(b"/calibrate/k%d" % (i % 64), b"v" * 32)], [], what="write"),
                lambda c, i: c.get(b"/calibrate/k%d" % (i % 64)), seconds, close=lambda c: c.close())
        finally:
            etcd.stop()
    return served


def _hammer(client: Any, write: Any, read: Any, seconds: float, close: Any = None) -> float:
    done = [0] * CALIBRATION_THREADS
    start, stop = threading.Barrier(CALIBRATION_THREADS + 1), threading.Event()

    def run(index: int) -> None:
        c = client()
        start.wait()
        operation = write if index % 2 else read
        i = 0
        while not stop.is_set():
            operation(c, i)
            i += 1
        done[index] = i
        if close is not None:
            close(c)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(CALIBRATION_THREADS)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.monotonic()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(30)
    return sum(done) / (time.monotonic() - began)


def needs(load: scale_model.Load, served: dict[str, float], store: str) -> str:
    """In words: whether one store of this kind, as measured here, carries the load."""
    capacity = served.get("etcd" if store.startswith("etcd") else "tcpstore")
    peak = max(load.failure_ops_per_s, load.steady_ops_per_s)
    if capacity is None:
        return "not calibrated"
    share = peak / capacity
    return f"{share:.0%} of one {'etcd member' if store.startswith('etcd') else 'TCPStore'} measured here"


def markdown(found: dict[str, list[scale_model.Load]], served: dict[str, float]) -> str:
    lines = ["| store | ranks (nodes) | steady ops/s | a failure: ops | ops/s over 10 s | one store, as measured here |",
             "|---|---|---:|---:|---:|---|"]
    for store, rows in found.items():
        for load in rows:
            lines.append(f"| {store} | {load.ranks:,} ({load.nodes:,}) | {load.steady_ops_per_s:,.0f} | "
                         f"{load.failure_ops:,.0f} | {load.failure_ops_per_s:,.0f} | {needs(load, served, store)} |")
    capacities = ", ".join(f"{name} {rate:,.0f} ops/s" for name, rate in served.items())
    lines.append("")
    lines.append(f"One store served, on this machine ({CALIBRATION_THREADS} client threads): {capacities}.")
    return "\n".join(lines)


def capacity_section(table: dict[str, dict[int, dict[str, Any]]], *, calibrated: bool = True) -> dict[str, Any]:
    """Print the capacity model; what --json keeps of it."""
    found = loads(table)
    if not found:
        return {}
    served = calibrate() if calibrated else {}
    text = markdown(found, served)
    print()
    print("capacity model (per-rank figures at the largest N measured; a failure: a node lost, every agent in a "
          "new round, or with train-on the survivors' shrink and the replacements' join):")
    print(text)
    return {"served_ops_per_s": served, "markdown": text, "loads": {
        store: [{"ranks": load.ranks, "nodes": load.nodes, "steady_ops_per_s": round(load.steady_ops_per_s),
                 "failure_ops": round(load.failure_ops), "failure_ops_per_s": round(load.failure_ops_per_s)}
                for load in rows] for store, rows in found.items()}}
