"""How the control-plane simulator (scale.py) runs N simulated ranks: threads, spread over processes.

A path's ranks (or nodes) are threads; with `procs` > 1 they are split over that many child processes
(`python benchmarks/scale.py --child ...`), each running its slice. Every rank talks to the store
under test through a client of its own, wrapped in a `CountingStore` (a TCPStore connection), or
through an `EtcdClient` whose stubs count (etcd). The phases of a path start together: `Slice.barrier`
meets every rank of every process, through a second store (the control store) that no measured code
touches, so the barriers cost the measured store nothing.

A child prints one line, `SCALE-RESULT <json>`: per rank its operations and bytes in each phase, and
each phase's start and end (wall clock), which the parent merges.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from scale_count import CountingStore, Tally

HERE = Path(__file__).resolve().parent
RESULT = "SCALE-RESULT "
STORE_TIMEOUT = timedelta(seconds=900)
MEMORY_DIR = "/dev/shm" if Path("/dev/shm").is_dir() else None
"""Where etcd keeps its data in the simulator: memory, so that what is measured is the control plane's
operations, not this machine's disk (each etcd write waits for an fsync)."""
RANK_STACK = 512 * 1024
"""Thousands of rank threads: their stacks are small."""


def serve_store(*, libuv: bool = True) -> dist.TCPStore:
    """A TCPStore server on a free loopback port (libuv: torch's server for thousands of clients)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=libuv, timeout=STORE_TIMEOUT,
                         wait_for_workers=False, multi_tenant=True)


def connect(port: int, *, attempts: int = 20) -> dist.TCPStore:
    """A client of the store at `port`: connects are staggered and retried with jitter, as thousands
    of agents at once need (pytorch#109200)."""
    for attempt in range(attempts):
        try:
            return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=STORE_TIMEOUT, use_libuv=True)
        except (RuntimeError, ValueError):
            if attempt == attempts - 1:
                raise
            time.sleep(0.05 * (1 + attempt) * (0.5 + secrets.randbelow(1000) / 1000))
    raise AssertionError("unreachable")


@dataclass
class Phase:
    """One phase of a path: each rank's operations and bytes in it, and when it ran."""

    ops: dict[int, int] = field(default_factory=dict)
    bytes: dict[int, int] = field(default_factory=dict)
    collective_bytes: dict[int, int] = field(default_factory=dict)
    started: float = float("inf")
    ended: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Slice:
    """This process's share of a path's ranks, and how they meet the others (see the module docstring)."""

    path: str
    n: int
    ranks: list[int]
    store_port: int | None
    control_port: int
    procs: int
    etcd: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    phases: dict[str, Phase] = field(default_factory=dict)
    tallies: dict[int, Tally] = field(default_factory=dict)
    shared: dict[str, Any] = field(default_factory=dict)
    """What this process's rank threads share (a simulated clock, the reports of a verdict)."""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _barrier: threading.Barrier | None = None
    _control: Any = None
    _phase_marks: dict[tuple[str, int], tuple[int, int, int]] = field(default_factory=dict)
    _clients: list[Any] = field(default_factory=list)

    def tally(self, rank: int) -> Tally:
        with self._lock:
            return self.tallies.setdefault(rank, Tally())

    def client(self, rank: int) -> CountingStore:
        """A store client for `rank`, counted in its tally: a connection of its own (as every agent and worker
        has), or with `params["pool"]` = K one of K connections this process's ranks share (a test's quick
        form: the counts are the same, the server sees fewer connections)."""
        assert self.store_port is not None
        pool = int(self.params.get("pool", 0))
        if pool:
            with self._lock:
                shared = self.shared.setdefault("pool", [])
                if len(shared) < pool:
                    shared.append(connect(self.store_port))
                inner = shared[rank % len(shared)]
        else:
            inner = connect(self.store_port)
        store = CountingStore(inner, self.tally(rank))
        with self._lock:  # a Store written in Python lives only as long as its Python object: kept here
            self._clients.append(store)
        return store

    def barrier(self, name: str, action: Callable[[], None] | None = None) -> None:
        """Every rank of every process arrives here before any leaves; `action` runs once per process
        while they wait (after every process arrived)."""
        with self._lock:
            if self._barrier is None:
                self._barrier = threading.Barrier(len(self.ranks))
                self._control = connect(self.control_port)
        index = self._barrier.wait()
        if index == 0:
            self._meet(name)
            if action is not None:
                action()
        self._barrier.wait()

    def _meet(self, name: str) -> None:
        if self.procs == 1:
            return
        key = f"barrier/{name}"
        if self._control.add(key, 1) == self.procs:
            self._control.set(key + "/go", "1")
        else:
            self._control.wait([key + "/go"], STORE_TIMEOUT)

    def begin(self, phase: str, rank: int) -> None:
        """`rank` starts `phase`: its counts from here on are the phase's."""
        tally = self.tally(rank)
        ops, nbytes = tally.snapshot()
        with self._lock:
            self._phase_marks[(phase, rank)] = (ops, nbytes, tally.collective_bytes)
            record = self.phases.setdefault(phase, Phase())
            record.started = min(record.started, time.time())

    def end(self, phase: str, rank: int) -> None:
        tally = self.tally(rank)
        ops, nbytes = tally.snapshot()
        with self._lock:
            first_ops, first_bytes, first_collective = self._phase_marks.pop((phase, rank))
            record = self.phases[phase]  # a phase a rank enters several times (each look) adds up
            record.ops[rank] = record.ops.get(rank, 0) + ops - first_ops
            record.bytes[rank] = record.bytes.get(rank, 0) + nbytes - first_bytes
            record.collective_bytes[rank] = record.collective_bytes.get(rank, 0) + tally.collective_bytes - first_collective
            record.ended = max(record.ended, time.time())

    def note(self, phase: str, key: str, value: Any) -> None:
        """A figure of `phase` this process adds (lists are joined across processes, numbers summed)."""
        with self._lock:
            extra = self.phases.setdefault(phase, Phase()).extra
            if isinstance(value, list):
                extra.setdefault(key, []).extend(value)
            else:
                extra[key] = extra.get(key, 0) + value

    def to_json(self) -> dict[str, Any]:
        return {name: {"ops": p.ops, "bytes": p.bytes, "collective_bytes": p.collective_bytes, "started": p.started,
                       "ended": p.ended, "extra": p.extra} for name, p in self.phases.items()}


def run_threads(sl: Slice, body: Callable[[Slice, int], None]) -> None:
    """`body(sl, rank)` on a thread per rank of `sl`; a rank that raised fails the whole run, named."""
    errors: list[tuple[int, BaseException]] = []
    threading.stack_size(RANK_STACK)

    def rank_thread(rank: int) -> None:
        try:
            body(sl, rank)
        except BaseException as exc:  # noqa: BLE001 - reported below, with its rank
            errors.append((rank, exc))
            if sl._barrier is not None:
                sl._barrier.abort()

    threads = [threading.Thread(target=rank_thread, args=(rank,), name=f"sim-rank-{rank}", daemon=True) for rank in sl.ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    real = [(rank, exc) for rank, exc in errors if not isinstance(exc, threading.BrokenBarrierError)]
    if real or errors:
        rank, exc = (real or errors)[0]
        raise RuntimeError(f"simulated rank {rank} of {sl.path} failed: {type(exc).__name__}: {exc}") from exc


def merge(results: list[dict[str, Any]]) -> dict[str, Phase]:
    """The phases of every process's slice, as one."""
    merged: dict[str, Phase] = {}
    for result in results:
        for name, raw in result.items():
            phase = merged.setdefault(name, Phase())
            phase.ops.update({int(k): v for k, v in raw["ops"].items()})
            phase.bytes.update({int(k): v for k, v in raw["bytes"].items()})
            phase.collective_bytes.update({int(k): v for k, v in raw["collective_bytes"].items()})
            phase.started = min(phase.started, raw["started"])
            phase.ended = max(phase.ended, raw["ended"])
            for key, value in raw["extra"].items():
                if isinstance(value, list):
                    phase.extra.setdefault(key, []).extend(value)
                else:
                    phase.extra[key] = phase.extra.get(key, 0) + value
    return merged


def spread(path: str, n: int, *, procs: int, store_port: int | None, control_port: int, etcd: str | None,
           params: dict[str, Any], timeout: float) -> dict[str, Phase]:
    """Run `path` with `n` ranks split over `procs` child processes; their merged phases."""
    procs = max(1, min(procs, n))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
           "TORCHREVIVE_SNAPSHOT_SECRET": params.get("secret", "s" * 32), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    children = []
    for index in range(procs):
        ranks = list(range(index, n, procs))
        spec = {"path": path, "n": n, "ranks": ranks, "store_port": store_port, "control_port": control_port,
                "procs": procs, "etcd": etcd, "params": params}
        children.append(subprocess.Popen([sys.executable, str(HERE / "scale.py"), "--child", json.dumps(spec)],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    results, failures = [], []
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            out, err = child.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in children:
                other.kill()
            raise RuntimeError(f"{path} at N={n}: the simulation ran past {timeout:.0f} s") from None
        line = next((x for x in out.splitlines() if x.startswith(RESULT)), None)
        if child.returncode != 0 or line is None:
            failures.append(f"exit {child.returncode}: {(err.strip().splitlines() or ['no output'])[-1][:300]}")
        else:
            results.append(json.loads(line[len(RESULT):]))
    if failures:
        raise RuntimeError(f"{path} at N={n}: a simulation process failed ({failures[0]})")
    return merge(results)
