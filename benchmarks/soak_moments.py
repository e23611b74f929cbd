"""The moments the soak (benchmarks/soak.py) kills a worker at, and how each is aimed.

Each incident draws one kind from `KINDS`. Some are aimed from outside, by the clock and by what the
job writes (the event log, the agents' logs); the others by a fault point (elastic._shared.protocol.
fault_hook) that kills the worker that reaches it, armed one at a time:

    mid_step            a random worker, at a random moment of a steady step
    checkpoint_save     fault point during_write: a worker while it writes a periodic checkpoint
    memory_snapshot     during_snapshot: while it copies an in-memory snapshot
    vote                during_vote: at a vote step, before it reads the vote in flight
    replica_check       during_replica_check: before a replica check's exchange
    rendezvous_round    a kill, then a worker of another node once an agent logs that it restarts its
                        group (under restart: the rendezvous round; under keep/train-on: the heal)
    heal                a kill, then during_heal: a survivor in its heal (restart: a restore's read,
                        before_read, the nearest a new round has)
    catch_up            a kill, then during_catch_up: the replacement while it takes a live member's
                        state (restart: during_read, the restarted workers' restore)
    after_heal          a kill, then another at a random moment of the first steps after the recovery
    replacement         a worker that was itself a replacement (the newest process), mid-step
    pair_nodes          two kills less than a second apart on different nodes
    pair_same_node      a kill, then the replacement on the same node as soon as it exists (< 1 s)

A fault point is armed through `ELASTIC_FAULT`'s `once` marks (elastic.chaos.faults): every point's
entry is in the job's environment from the start, with its mark made (disarmed); `Arms.arm` deletes
the mark, and the first worker to reach the point makes it again and SIGKILLs itself: the mark's time
is the kill's. A point the job does not reach within the kind's wait is disarmed again and the
incident becomes a `mid_step` one (recorded so: the moment actually hit, not the one drawn).
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic._agent.launcher.proctree import descendants, worker_rank
from elastic.chaos.harness import ChaosJob

KINDS = ("mid_step", "checkpoint_save", "memory_snapshot", "vote", "replica_check", "rendezvous_round", "heal",
         "catch_up", "after_heal", "replacement", "pair_nodes", "pair_same_node")
POINT_OF = {"checkpoint_save": "during_write", "memory_snapshot": "during_snapshot", "vote": "during_vote",
            "replica_check": "during_replica_check"}
"""The single kills aimed by a fault point."""
SECOND_POINT = {"heal": ("during_heal", "before_read"), "catch_up": ("during_catch_up", "during_read")}
"""The pairs whose second kill is a fault point: (with keep/train-on, with restart)."""
POINTS = ("during_write", "during_snapshot", "during_vote", "during_replica_check", "during_heal", "before_read",
          "during_catch_up", "during_read")
ARM_WAIT_S = 90.0
"""How long a single kill's fault point may take to come (a checkpoint every 50 steps)."""
SECOND_WAIT_S = 15.0
"""How long a pair's second moment may take to come after the first kill."""


def entry(point: str) -> str:
    return f"{point}@0+:rank=any:restart=any:once"


def fault_environment(once_dir: Path) -> dict[str, str]:
    """The job's `ELASTIC_FAULT` and its marks' folder, every point disarmed (its mark made)."""
    once_dir.mkdir(parents=True, exist_ok=True)
    arms = Arms(once_dir)
    for point in POINTS:
        arms.disarm(point)
    return {"ELASTIC_FAULT": ",".join(entry(p) for p in POINTS), "ELASTIC_FAULT_ONCE_DIR": str(once_dir)}


class Arms:
    """The `once` marks of the soak's fault points (elastic.chaos.faults.FaultInjector._first_to_fire's names)."""

    def __init__(self, once_dir: Path) -> None:
        self.once_dir = once_dir

    def mark(self, point: str) -> Path:
        return self.once_dir / hashlib.sha256(entry(point).encode()).hexdigest()[:16]

    def arm(self, point: str) -> None:
        self.mark(point).unlink(missing_ok=True)

    def disarm(self, point: str) -> float | None:
        """Make the mark again; the time the point fired at when a worker made it first (else None)."""
        try:
            os.close(os.open(self.mark(point), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return self.mark(point).stat().st_mtime
        return None

    def wait_fired(self, point: str, timeout: float, room: Callable[[], bool] = lambda: True) -> float | None:
        """The time `point` fired at, armed, within `timeout` s and while `room()` (the job has steps left
        for an incident); None (and disarmed) when it did not."""
        deadline = time.monotonic() + timeout
        mark = self.mark(point)
        polls = 0
        while time.monotonic() < deadline and (polls % 50 or room()):  # (room reads the event log: twice a second)
            if mark.exists():
                return mark.stat().st_mtime
            polls += 1
            time.sleep(0.01)
        return self.disarm(point)


def live_workers(job: ChaosJob) -> dict[int, tuple[int, int]]:
    """rank -> (pid, agent index) of every live worker."""
    found: dict[int, tuple[int, int]] = {}
    for index, agent in enumerate(job.agents):
        if agent.poll() is None:
            for pid in descendants(agent.pid):
                rank = worker_rank(pid)
                if rank is not None and rank not in found and _alive(pid):
                    found[rank] = (pid, index)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def kill(job: ChaosJob, rank: int, pid: int, node: int, hit: str) -> dict[str, Any] | None:
    """SIGKILL `pid` (rank `rank` on agent `node`); its record, None when it was gone already."""
    at = time.time()
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    job.mark("SIGKILL", at)
    return {"time": at, "rank": rank, "node": node, "hit": hit}


def kill_one(job: ChaosJob, rng: random.Random, hit: str, *, not_node: int | None = None, rank: int | None = None,
             wait: float = 5.0) -> dict[str, Any] | None:
    """Kill a live worker (of `rank`, else of a node other than `not_node` when there is one, else any)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        workers = live_workers(job)
        if rank is not None:
            workers = {r: w for r, w in workers.items() if r == rank}
        others = {r: w for r, w in workers.items() if w[1] != not_node}
        pool = others or workers
        if pool:
            chosen = rng.choice(sorted(pool))
            record = kill(job, chosen, *pool[chosen], hit)
            if record is not None:
                return record
        time.sleep(0.01)
    return None


class LogWatch:
    """New lines of the agents' logs since the watch began (read by offset: the logs grow long)."""

    def __init__(self, job: ChaosJob) -> None:
        self.paths = [job.spec.workdir / f"agent{i}.log" for i in range(len(job.agents))]
        self.offsets = [p.stat().st_size if p.exists() else 0 for p in self.paths]

    def wait_for(self, text: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, path in enumerate(self.paths):
                with open(path, "rb") as log:
                    log.seek(self.offsets[i])
                    if text.encode() in log.read():
                        return True
            time.sleep(0.01)
        return False


def strike(job: ChaosJob, kind: str, rng: random.Random, arms: Arms, *, heals: bool, steady_s: float,
           first_pids: set[int], recovered: Callable[[float], bool],
           room: Callable[[], bool] = lambda: True) -> list[dict[str, Any]]:
    """Carry out one incident of `kind`; its kills (at least one). `heals`: the setting heals in place
    (keep, train-on); `steady_s`: a steady step; `first_pids`: the workers the job started with;
    `recovered(t)`: the job wrote a recovery event after time t; `room()`: the job has steps left for
    an incident (a fault point that does not come before it ends is given up)."""
    if kind in POINT_OF:
        point = POINT_OF[kind]
        arms.arm(point)
        fired = arms.wait_fired(point, ARM_WAIT_S, room)
        if fired is not None:
            return [{"time": fired, "rank": None, "node": None, "hit": point}]
        kind = "mid_step"  # never reached in time: recorded as what it became
    if kind == "replacement":
        newer = {r: w for r, w in live_workers(job).items() if w[0] not in first_pids}
        if newer:
            time.sleep(rng.uniform(0, steady_s))
            rank = max(newer, key=lambda r: newer[r][0])
            record = kill_one(job, rng, "replacement, mid-step", rank=rank)
            if record is not None:
                return [record]
        kind = "mid_step"
    time.sleep(rng.uniform(0, steady_s))
    watch = LogWatch(job)  # before the first kill: its agent's line may come at once
    first = kill_one(job, rng, "mid_step" if kind == "mid_step" else f"{kind}: first kill, mid-step")
    if first is None:
        raise RuntimeError(f"no live worker to kill:\n{job.logs()}")
    if kind in ("mid_step", "replacement"):
        return [first]
    second: dict[str, Any] | None = None
    if kind == "pair_nodes":
        time.sleep(rng.uniform(0, 0.9))
        second = kill_one(job, rng, "pair_nodes: second kill, another node", not_node=first["node"], wait=0.1)
    elif kind == "pair_same_node":
        deadline = time.monotonic() + 1.0
        while second is None and time.monotonic() < deadline:
            fresh = {r: w for r, w in live_workers(job).items() if w[1] == first["node"] and w[0] not in first_pids}
            fresh = {r: w for r, w in fresh.items() if r == first["rank"] or not heals}
            if fresh:
                rank = max(fresh, key=lambda r: fresh[r][0])
                second = kill(job, rank, *fresh[rank], "pair_same_node: its replacement")
            time.sleep(0.005)
    elif kind == "rendezvous_round":
        seen = watch.wait_for("will restart worker group", SECOND_WAIT_S)
        second = kill_one(job, rng, "rendezvous_round: another node's worker as the agents regroup" if seen else
                          "rendezvous_round: no agent said it regroups; another node's worker", not_node=first["node"],
                          wait=1.0)
    elif kind in SECOND_POINT:
        point = SECOND_POINT[kind][0 if heals else 1]
        arms.arm(point)
        fired = arms.wait_fired(point, SECOND_WAIT_S)
        if fired is not None:
            second = {"time": fired, "rank": None, "node": None, "hit": point}
    elif kind == "after_heal":
        deadline = time.monotonic() + SECOND_WAIT_S
        while not recovered(first["time"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        if recovered(first["time"]):
            time.sleep(rng.uniform(0, 2 * steady_s))
            second = kill_one(job, rng, "after_heal: the first steps after the recovery", wait=1.0)
    return [first] if second is None else [first, second]
