"""Run an elastic job of several torchrun agents on this machine and hurt it.

`ChaosJob` starts N agents of one job (the GPT recipe by default) under
`elastic.launcher` or stock torchrun, with c10d or etcd-v3 rendezvous, on
loopback or each on a host of its own (`elastic.chaos.netns`), and offers the
faults a cluster deals out: SIGKILL a worker, SIGKILL a whole agent with its
workers (node loss), a new agent joining (scale up), SIGSTOP a worker (a
hang), SIGTERM a worker (preemption), a cut network link (partition), an etcd
that stops and comes back. Faults that must strike at an exact point inside a
worker (just before a checkpoint commits) go through `ELASTIC_FAULT` (see
`elastic.chaos.faults`).

Each scenario (`SCENARIOS`) starts a job, injects its fault once training is
under way, waits for the end, and returns a `ScenarioResult`: exit codes, the
recovery time (fault -> first completed step of the restarted group, from the
event log), whether the final checkpoint verifies, and the exactly-once audit
of the samples trained on (`elastic.chaos.samples`).

Invariant: every process it starts is killed, and every cable it cut is
plugged back, when the job is closed, whatever happened. The network and the
etcd a job uses belong to the caller.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from elastic.chaos.etcd import EtcdServer
from elastic.chaos.netns import INTERFACE, VirtualNetwork, free_port
from elastic.chaos.samples import LOG_ENV as SAMPLE_LOG_ENV
from elastic.chaos.samples import SampleAudit, audit
from elastic.errors import CorruptCheckpoint, UsageError
from elastic.launcher.keeper import BASE_ENV as SNAPSHOT_BASE_ENV
from elastic.launcher.keeper import DIRECTORY as SNAPSHOT_DIRECTORY
from elastic.launcher.proctree import descendants, worker_rank
from elastic.storage.directory import CheckpointStore

logger = logging.getLogger(__name__)

RECIPE = Path("recipes") / "gpt.py"


def find_recipe(given: str | os.PathLike[str] | None = None) -> Path:
    """The GPT recipe the jobs run: `given`, else recipes/gpt.py in the current directory, else beside
    this package in a source checkout. An installed package has no recipes: one `UsageError` line."""
    if given is not None:
        path = Path(given)
        if not path.is_file():
            raise UsageError(f"--recipe {path}: no such file")
        return path.resolve()
    for candidate in (Path.cwd() / RECIPE, Path(__file__).resolve().parents[2] / RECIPE):
        if candidate.is_file():
            return candidate
    raise UsageError(
        f"the chaos harness runs the GPT recipe, {RECIPE} of a torchrevive checkout, and finds none in the "
        "current directory or beside this package: run it from a checkout, or pass --recipe PATH"
    )


@dataclass
class JobSpec:
    """One elastic job: how many agents, which rendezvous, which script."""

    workdir: Path
    script_args: Sequence[str]
    agents: int = 2
    nnodes: str = "1:3"
    backend: str = "c10d"
    endpoint: str | None = None
    """c10d: a free loopback port is picked; etcd-v3: HOST:PORT of etcd (required)."""
    max_restarts: int = 3
    launcher: str = "ours"
    """`ours` (python -m elastic.launcher) or `stock` (torch.distributed.run)."""
    script: Path | None = None
    """The training script; None: the GPT recipe (`find_recipe`)."""
    rdzv_conf: str = "join_timeout=60,close_timeout=10"
    env: dict[str, str] = field(default_factory=dict)
    run_id: str = "chaos"
    sample_log: Path | None = None
    """Record every rank's samples here (`elastic.chaos.samples`) for the exactly-once audit."""
    network: VirtualNetwork | None = None
    """Put each agent on a host of its own (a network namespace); None: all on loopback."""
    etcd: EtcdServer | None = None
    """The etcd of an etcd-v3 job, when the harness started it (and may restart it)."""


# torch's log lines: "I1123 06:10:31.355000 2706 path/file.py:942] message"
_TORCH_LOG_LINE = re.compile(r"^[IWE](?P<date>\d{4}) (?P<time>\d\d:\d\d:\d\d\.\d+) \d+ \S+\] (?P<message>.*)$", re.M)


class ChaosJob:
    """The agents of one job, their logs, its event log, and ways to hurt it."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        spec.workdir.mkdir(parents=True, exist_ok=True)
        self.events_path = spec.workdir / "events.jsonl"
        if spec.network is not None and spec.network.hosts == 0:
            spec.network.add_host()  # agent 0's host: the c10d store's address must exist now
        self.endpoint = spec.endpoint or f"{self.host_address(0)}:{free_port()}"
        if spec.backend != "c10d" and spec.endpoint is None:
            raise ValueError(f"the {spec.backend} rendezvous needs an endpoint")
        self.agents: list[subprocess.Popen] = []
        self.faults: list[tuple[str, float]] = []

    def host_address(self, index: int) -> str:
        return self.spec.network.address(index) if self.spec.network else "127.0.0.1"

    def command(self, index: int) -> list[str]:
        """Agent `index`'s command line (on its own host when the job has a network)."""
        launcher = ["-m", "elastic.launcher"] if self.spec.launcher == "ours" else ["-m", "torch.distributed.run"]
        rdzv_conf = self.spec.rdzv_conf
        if self.spec.network and self.spec.backend == "c10d":
            # torch guesses which agent hosts the c10d store from the hostname, which every
            # namespace shares: say it outright.
            rdzv_conf = ",".join(filter(None, [rdzv_conf, f"is_host={str(index == 0).lower()}"]))
        command = [
            sys.executable, *launcher,
            f"--nnodes={self.spec.nnodes}", "--nproc-per-node=1",
            f"--rdzv-backend={self.spec.backend}", f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.spec.run_id}", f"--rdzv-conf={rdzv_conf}",
            f"--max-restarts={self.spec.max_restarts}", f"--local-addr={self.host_address(index)}",
            *self.script_command(), "--events", str(self.events_path),
        ]
        return self.spec.network.wrap(index, command) if self.spec.network else command

    def script_command(self) -> list[str]:
        script = [str(self.spec.script or find_recipe()), *self.spec.script_args]
        return ["-m", "elastic.chaos.samples", *script] if self.spec.sample_log else script

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}}
        if self.spec.launcher == "stock":
            env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # stock means torch's defaults
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", LOGLEVEL="INFO")
        if self.spec.sample_log:
            env[SAMPLE_LOG_ENV] = str(self.spec.sample_log)
        if self.spec.network:
            env["GLOO_SOCKET_IFNAME"] = INTERFACE  # the hostname resolves to no address inside a namespace
        # The agents' snapshot keepers keep their shared memory here (in /dev/shm), so that a node
        # loss can wipe the lost node's, as a real one would.
        env[SNAPSHOT_BASE_ENV] = str(self.snapshot_base)
        env.update(self.spec.env)
        return env

    @property
    def snapshot_base(self) -> Path:
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else self.spec.workdir
        return base / f"chaos-{self.spec.run_id}"

    def wipe_node_memory(self, pid: int) -> None:
        """What a node loss takes with it: the shared memory of the agent `pid`'s snapshot keeper."""
        for directory in (self.snapshot_base / SNAPSHOT_DIRECTORY).glob(f"*-{pid}-*"):
            shutil.rmtree(directory, ignore_errors=True)

    def add_agent(self, host: int | None = None) -> subprocess.Popen:
        """Start one more agent (the first ones, or a node joining later), on host
        `host` (default: a host of its own; a relaunch reuses the first ones)."""
        index = len(self.agents)
        host = index if host is None else host
        if self.spec.network is not None and self.spec.network.hosts <= host:
            self.spec.network.add_host()
        with open(self.spec.workdir / f"agent{index}.log", "wb") as log:
            agent = subprocess.Popen(self.command(host), stdout=log, stderr=subprocess.STDOUT, env=self.environment())
        self.agents.append(agent)
        return agent

    def start(self) -> ChaosJob:
        self.add_agent()
        if self.spec.backend == "c10d":
            # The agent that binds the endpoint first hosts c10d's rendezvous store,
            # the one node a c10d job cannot lose: make that agent 0, always.
            self._wait_until_listening(self.endpoint, self.agents[0])
        for _ in range(self.spec.agents - 1):
            self.add_agent()
        return self

    def relaunch(self, script_args: Sequence[str] | None = None) -> None:
        """Launch the job again, once every agent of the last launch has exited: the
        same agents on the same hosts, `--rdzv-id` and endpoint (what a user, or
        Kubernetes, does to resume a job that ended). `script_args`, if given,
        replace the script's arguments from now on."""
        if any(agent.poll() is None for agent in self.agents):
            raise RuntimeError("a relaunch needs every agent of the previous launch to have exited")
        if script_args is not None:
            self.spec.script_args = list(script_args)
        first = len(self.agents)
        self.add_agent(host=0)
        if self.spec.backend == "c10d":
            self._wait_until_listening(self.endpoint, self.agents[first])
        for host in range(1, self.spec.agents):
            self.add_agent(host=host)

    def _wait_until_listening(self, endpoint: str, agent: subprocess.Popen, timeout: float = 60) -> None:
        import socket

        host, port = endpoint.rsplit(":", 1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and agent.poll() is None:
            try:
                with socket.create_connection((host, int(port)), timeout=1):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"the first agent never served {endpoint}:\n{self.logs()}")

    # --- observing -------------------------------------------------------------

    def records(self) -> list[dict[str, Any]]:
        out = []
        if self.events_path.exists():
            for line in self.events_path.read_text().splitlines():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a torn last line
        return out

    def last_step(self, after: float = 0.0) -> int:
        return max((r["step"] for r in self.records() if r["event"] == "step" and r["time"] > after), default=0)

    def wait_for_recovery(self, fault_time: float, timeout: float = 180) -> float:
        """Seconds from `fault_time` to the first step of a group started after it."""
        return self._poll(lambda: self.recovery_seconds(fault_time), timeout, "a recovery from the fault")

    def _poll(self, found: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
        """`found()` once it is not None; fails naming `what` at the deadline or when
        every agent has exited."""
        deadline = time.monotonic() + timeout
        while (value := found()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} in {timeout:g} s:\n{self.logs()}")
            if all(a.poll() is not None for a in self.agents):
                raise RuntimeError(f"every agent exited before {what}:\n{self.logs()}")
            time.sleep(interval)
        return value

    def agent_log(self, index: int) -> str:
        return (self.spec.workdir / f"agent{index}.log").read_text(errors="replace")

    def workers(self) -> dict[int, int]:
        """rank -> pid of every live worker."""
        found = {}
        for agent in self.agents:
            if agent.poll() is None:
                for pid in descendants(agent.pid):  # parents first: a worker before its children
                    rank = worker_rank(pid)
                    if rank is not None:
                        found.setdefault(rank, pid)
        return found

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}" for p in sorted(self.spec.workdir.glob("agent*.log"))
        )

    def wait_for_step(self, step: int, timeout: float = 180, after: float = 0.0) -> None:
        """Wait until a step >= `step` completes (one completed after time `after`)."""
        self._poll(lambda: True if self.last_step(after) >= step else None, timeout, f"step {step}", interval=0.01)

    def wait_for_world_size(self, world_size: int, after: float, timeout: float = 180) -> float:
        """Wait for a step trained at `world_size` after time `after`; returns its time."""

        def step_time() -> float | None:
            return next(
                (r["time"] for r in self.records()
                 if r["event"] == "step" and r["world_size"] == world_size and r["time"] > after),
                None,
            )

        return self._poll(step_time, timeout, f"step at world size {world_size}")

    def wait(self, timeout: float = 300) -> list[int | None]:
        """Exit codes of every agent (None for one still running at the deadline)."""
        deadline = time.monotonic() + timeout
        for agent in self.agents:
            try:
                agent.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [a.poll() for a in self.agents]

    def close(self) -> None:
        """Kill whatever is left (agents, their workers, stopped ones included) and
        plug every cable back, so the network can serve the next job."""
        for index, agent in enumerate(self.agents):
            if agent.poll() is None:
                self._kill_node(index)
        for index in range(self.spec.network.hosts if self.spec.network else 0):
            self.spec.network.heal(index)
        shutil.rmtree(self.snapshot_base, ignore_errors=True)

    def __enter__(self) -> ChaosJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- faults ------------------------------------------------------------------

    def signal_worker(self, signum: int, rank: int | None = None, rng: random.Random | None = None) -> int:
        """Send `signum` to the worker of `rank` (a random one if None); returns that rank."""
        deadline = time.monotonic() + 60
        while not (workers := self.workers()) or (rank is not None and rank not in workers):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no worker of rank {rank} to signal:\n{self.logs()}")
            time.sleep(0.05)
        chosen = rank if rank is not None else (rng or random.Random()).choice(sorted(workers))
        self.faults.append((signal.Signals(signum).name, time.time()))
        os.kill(workers[chosen], signum)
        return chosen

    def kill_agent(self, index: int) -> None:
        """Node loss: SIGKILL an agent and its workers at once."""
        self.faults.append(("node-loss", time.time()))
        self._kill_node(index)

    def _kill_node(self, index: int) -> None:
        # torchrun starts each worker in a session of its own (or under a fork server): signal them one by one.
        agent = self.agents[index]
        workers = descendants(agent.pid)
        for pid in [agent.pid, *workers]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        agent.wait()
        self.wipe_node_memory(agent.pid)

    def cut_link(self, index: int) -> None:
        """Network partition: agent `index`'s host loses its link (connections stall, no reset)."""
        if self.spec.network is None:
            raise ValueError("cutting a link needs agents on hosts of their own (JobSpec.network)")
        self.faults.append(("partition", time.time()))
        self.spec.network.cut(index)

    def heal_link(self, index: int) -> None:
        if self.spec.network is not None:
            self.spec.network.heal(index)

    def mark(self, name: str, at: float | None = None) -> None:
        """Record a fault injected from outside (etcd restarted, ELASTIC_FAULT)."""
        self.faults.append((name, time.time() if at is None else at))

    # --- verdicts -----------------------------------------------------------------

    def recovery_seconds(self, fault_time: float) -> float | None:
        """Fault -> first step completed by a worker group that started after it."""
        restarted = False
        for record in self.records():
            if record["time"] <= fault_time:
                continue
            if record["event"] == "start":
                restarted = True
            elif record["event"] == "step" and restarted:
                return record["time"] - fault_time
        return None

    def recovery_phases(self, fault_time: float) -> dict[str, float] | None:
        """Where a recovery's time went, in seconds after the fault: `detected` (an agent
        decided to restart its workers), `rendezvous` (the new round's workers start),
        `restored` (rank 0 reloaded the checkpoint: its 'start' event) and `step` (the
        first step). From the agents' logs (torch logs at INFO) and the event log."""
        step = self.recovery_seconds(fault_time)
        if step is None:
            return None
        logged = self._agent_log_times()
        restart = [t for t, what in logged if t > fault_time and "will restart worker group" in what]
        started = [t for t, what in logged if restart and t > restart[0] and "Starting worker group" in what]
        restored = [r["time"] for r in self.records() if r["event"] == "start" and r["time"] > fault_time]
        if not (restart and started and restored):
            return None
        return {
            "detected": min(restart) - fault_time,
            "rendezvous": min(started) - fault_time,
            "restored": restored[0] - fault_time,
            "step": step,
        }

    def _agent_log_times(self) -> list[tuple[float, str]]:
        """(unix time, line) of every timestamped line torch logged in the agents' logs."""
        year = time.localtime().tm_year
        found = []
        for index in range(len(self.agents)):
            for match in _TORCH_LOG_LINE.finditer(self.agent_log(index)):
                stamp = datetime.strptime(f"{year}{match['date']} {match['time']}", "%Y%m%d %H:%M:%S.%f")
                found.append((stamp.timestamp(), match["message"]))
        return sorted(found)

    def restart_times(self) -> list[float]:
        """When each worker group after the first started (from its 'start' event)."""
        return [r["time"] for r in self.records() if r["event"] == "start"][1:]


@dataclass
class ScenarioResult:
    scenario: str
    exit_codes: list[int | None]
    expected_codes: list[int | None]
    end_step: int | None
    max_steps: int
    recovery_seconds: list[float | None]
    final_checkpoint: str | None
    checkpoint_error: str | None
    samples: SampleAudit
    logs: str
    report: Path | None = None
    """The run's picture (`elastic.report`), when matplotlib is installed."""
    stops_at: int | None = None
    """For a job meant to stop rather than finish: the step of the checkpoint it must leave intact."""
    redone: list[int] = field(default_factory=list)
    """Per restore after a fault: steps finished before it that the job trained again."""
    max_redone: int | None = None
    """The most steps a fault may cost (None: not judged, e.g. under stock torchrun: no snapshots)."""

    @property
    def redone_ok(self) -> bool:
        return self.max_redone is None or all(r <= self.max_redone for r in self.redone)

    @property
    def samples_ok(self) -> bool:
        """Every step 1..max_steps survived once and used each sample of an epoch once
        (up to where the job stopped, for one meant to stop)."""
        if self.stops_at is not None:
            return self.samples.ok and self.samples.first_step == 1
        return self.samples.ok and (self.samples.first_step, self.samples.last_step) == (1, self.max_steps)

    @property
    def ok(self) -> bool:
        return (
            self.exit_codes == self.expected_codes
            and self.end_step == (self.max_steps if self.stops_at is None else None)
            and self.final_checkpoint is not None
            and all(r is not None for r in self.recovery_seconds)
            and self.samples_ok
            and self.redone_ok
        )

    def summary(self) -> str:
        recoveries = ", ".join("none" if r is None else f"{r:.1f} s" for r in self.recovery_seconds) or "-"
        verdict = "ok" if self.ok else "FAILED"
        return (
            f"{self.scenario}: {verdict}; exit codes {self.exit_codes} (expected {self.expected_codes}); "
            f"ended at step {self.end_step}/{self.max_steps}; recovery {recoveries}; "
            f"steps redone {self.redone or '-'}" + (f" (at most {self.max_redone})" if self.max_redone is not None else "") + "; "
            f"final checkpoint {self.final_checkpoint or self.checkpoint_error}; {self.samples.summary()}"
            + (f"; picture {self.report}" if self.report else "")
        )


def draw_report(events: Path, out: Path, *, title: str) -> Path | None:
    """Draw the job's picture; None when it cannot be drawn (no matplotlib, no step ran)."""
    from elastic.errors import UsageError
    from elastic.report import load_events, render

    try:
        render(load_events(events), out, title=title)
    except UsageError as exc:  # no matplotlib, or nothing to draw
        logger.info("no report for %s: %s", events, exc)
        return None
    except Exception:  # noqa: BLE001 - a drawing bug must not fail the scenario it would illustrate
        logger.warning("drawing the report of %s failed", events, exc_info=True)
        return None
    return out


def verified_final_checkpoint(directory: Path, step: int) -> tuple[str | None, str | None]:
    """(name, None) when the checkpoint of `step` is committed and verifies, else (None, why)."""
    store = CheckpointStore(directory)
    for candidate in store.committed():
        try:
            manifest = store.verify(candidate)
        except CorruptCheckpoint as exc:
            return None, f"corrupt: {exc}"
        if manifest.step == step:
            return candidate.path.name, None
    return None, f"no verified checkpoint of step {step} in {directory}"


# --- scenarios ---------------------------------------------------------------------

Scenario = Callable[[ChaosJob, random.Random], list[int | None]]
"""Hurts a started job; returns the exit codes expected of its agents."""


def kill_worker(job: ChaosJob, rng: random.Random) -> list[int | None]:
    job.wait_for_step(rng.randint(12, 18))
    job.signal_worker(signal.SIGKILL, rng=rng)
    return [0] * len(job.agents)


def kill_during_save(job: ChaosJob, rng: random.Random, name: str = "kill-during-save") -> list[int | None]:
    # ELASTIC_FAULT=before_commit@20 (set by `scenario_env`) kills rank 0 between
    # writing step 20's files and committing them; the fault time is the last
    # event of the first group (the restarted group opens with restore, start).
    deadline = time.monotonic() + 180
    while not job.restart_times():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the job never restarted after the fault:\n{job.logs()}")
        time.sleep(0.05)
    records = job.records()
    second_start = [i for i, r in enumerate(records) if r["event"] == "start"][1]
    opening = second_start - (records[second_start - 1]["event"] == "restore")
    job.mark(name, at=records[opening - 1]["time"])
    return [0] * len(job.agents)


def kill_during_snapshot(job: ChaosJob, rng: random.Random) -> list[int | None]:
    # ELASTIC_FAULT=during_snapshot@15:rank=1 kills rank 1 while it copies step 15's state into
    # shared memory (after the data, before its header): that part must never be loaded.
    return kill_during_save(job, rng, name="kill-during-snapshot")


def node_loss(job: ChaosJob, rng: random.Random) -> list[int | None]:
    # Both nodes must be in the job before one is lost: on a busy machine the second
    # agent can miss the first round and join through a membership change later.
    job.wait_for_world_size(2, after=0.0)
    job.wait_for_step(rng.randint(12, 18))
    # Not agent 0: with c10d it hosts the rendezvous store, the one node a c10d job cannot lose.
    job.kill_agent(len(job.agents) - 1)
    return [0] * (len(job.agents) - 1) + [-signal.SIGKILL]


def scale_up(job: ChaosJob, rng: random.Random) -> list[int | None]:
    job.wait_for_step(rng.randint(12, 18))
    job.mark("scale-up")
    job.add_agent()
    return [0] * len(job.agents)


def hang(job: ChaosJob, rng: random.Random) -> list[int | None]:
    job.wait_for_step(rng.randint(12, 18))
    job.signal_worker(signal.SIGSTOP, rank=1)
    return [0] * len(job.agents)


def partition(job: ChaosJob, rng: random.Random) -> list[int | None]:
    """The last agent's host loses its network; the job goes on without it, and takes
    it back once the link returns."""
    job.wait_for_step(rng.randint(12, 18))
    lost = len(job.agents) - 1  # not agent 0: with c10d it hosts the rendezvous store
    job.cut_link(lost)
    job.wait_for_world_size(len(job.agents) - 1, after=job.faults[-1][1])
    healed = time.time()
    job.heal_link(lost)
    job.mark("heal", at=healed)
    job.wait_for_world_size(len(job.agents), after=healed)
    return [0] * len(job.agents)


def etcd_restart(job: ChaosJob, rng: random.Random) -> list[int | None]:
    """etcd goes down just as the job must rendezvous: a worker is killed while etcd
    is stopped, and etcd comes back (same data) 2 s later. The agents' etcd client
    retries through the outage (`read_timeout`) and the job recovers through it."""
    if job.spec.etcd is None:
        raise ValueError("the etcd-restart scenario needs an etcd the harness started (JobSpec.etcd)")
    job.wait_for_step(rng.randint(12, 18))
    job.spec.etcd.stop()
    job.mark("etcd-stop")
    job.signal_worker(signal.SIGKILL, rng=rng)
    time.sleep(2)
    job.spec.etcd.start()
    return [0] * len(job.agents)


def soak(job: ChaosJob, rng: random.Random) -> list[int | None]:
    """Faults on a schedule, in one job: a SIGKILL, a SIGTERM and a SIGSTOP of random
    workers, each once the job has recovered from the one before and trained on."""
    since = 0.0
    for signum in (signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP):
        started = [r for r in job.records() if r["event"] == "start" and r["time"] > since]
        job.wait_for_step((started[-1]["step"] if started else 0) + rng.randint(5, 10), after=since)
        job.signal_worker(signum, rng=rng)
        since = job.faults[-1][1]
        job.wait_for_recovery(since)
    return [0] * len(job.agents)


def preemption(job: ChaosJob, rng: random.Random) -> list[int | None]:
    job.wait_for_step(rng.randint(12, 18))
    job.signal_worker(signal.SIGTERM, rng=rng)
    return [0] * len(job.agents)


def relaunch(job: ChaosJob, rng: random.Random) -> list[int | None]:
    """The job's first launch trains a third to a half of the steps and ends (torch
    closes the rendezvous); the job is launched again with the same `--rdzv-id` and
    the full `--max-steps`, and must resume from the first launch's final
    checkpoint. The 'fault' is the relaunch, its recovery the time to the first step.
    (The final weights differ from an uninterrupted run's: the LR schedule follows
    --max-steps.) `run_scenario` leaves the first launch to this scenario
    (`LAUNCHES_ITSELF`)."""
    args = list(job.spec.script_args)
    at = args.index("--max-steps") + 1
    first_steps = rng.randint(int(args[at]) // 3, int(args[at]) // 2)
    job.spec.script_args = [*args[:at], str(first_steps), *args[at + 1 :]]
    job.start()
    codes = job.wait(300)
    if codes != [0] * len(codes):
        raise RuntimeError(f"the first launch ended with exit codes {codes}, not 0:\n{job.logs()}")
    job.mark("relaunch")
    job.relaunch(args)
    return [0] * len(job.agents)


def disk_full(job: ChaosJob, rng: random.Random) -> list[int | None]:
    """The checkpoint volume is full from step 20 on (`SCENARIO_FAULTS`: every save from
    then on fails with ENOSPC, on every restart). Training goes on past the first
    failures; the third in a row stops every worker with one line and exit 75, the
    step-15 checkpoint intact. Our launcher does not restart it (a restart would
    meet the same disk); stock torchrun restarts until --max-restarts is spent."""
    return [75 if job.spec.launcher == "ours" else 1] * len(job.agents)


def slow_storage(job: ChaosJob, rng: random.Random) -> list[int | None]:
    """Step 10's save and the final one each take 8 s (`SCENARIO_FAULTS`), longer than
    the watchdog (3 s) and the collective timeout (4 s, `SCENARIO_ARGS`): saves due
    meanwhile are skipped, nothing trips, the job finishes without a restart."""
    return [0] * len(job.agents)


SCENARIOS: dict[str, Scenario] = {
    "kill-worker": kill_worker,
    "kill-during-save": kill_during_save,
    "kill-during-snapshot": kill_during_snapshot,
    "node-loss": node_loss,
    "scale-up": scale_up,
    "hang": hang,
    "preemption": preemption,
    "partition": partition,
    "etcd-restart": etcd_restart,
    "soak": soak,
    "relaunch": relaunch,
    "disk-full": disk_full,
    "slow-storage": slow_storage,
}
NEEDS_NETWORK = {"partition"}
"""Scenarios that need agents on hosts of their own (network namespaces)."""
NEEDS_OWN_ETCD = {"etcd-restart"}
"""Scenarios that need the etcd-v3 backend on an etcd the harness started."""
LAUNCHES_ITSELF = {"relaunch"}
"""Scenarios that start the job themselves (with arguments of their own)."""


# Scenarios that change the world size need the job to outlast a new round
# (a joining agent first imports torch): they train longer.
SCENARIO_STEPS = {"scale-up": 400, "node-loss": 400, "partition": 800, "soak": 300}
# Jobs whose world size must stay 2 wait for both agents before the first round
# (with a minimum of 1, the first agent could train alone until the second joins).
SCENARIO_NNODES = {"scale-up": "1:3", "node-loss": "1:3", "partition": "1:3"}


# Faults the workers inject themselves (elastic.chaos.faults), per scenario.
SCENARIO_FAULTS = {
    "kill-during-save": "before_commit@20",
    "kill-during-snapshot": "during_snapshot@15:rank=1",
    "disk-full": "during_write@20+:do=enospc:restart=any",
    "slow-storage": "during_write@10:do=slow:for=8,during_write@40:do=slow:for=8",
}
# Recipe flags a scenario adds to the common ones.
SCENARIO_ARGS = {"slow-storage": ["--collective-timeout", "4"]}
# Scenarios whose job must stop instead of finishing: the step of the newest
# checkpoint that must be left intact.
SCENARIO_STOPS_AT = {"disk-full": 15}


# Under our launcher (in-memory snapshots every step) a fault costs at most this many
# finished steps (the restore events' `redone`).
SCENARIO_MAX_REDONE = {"kill-worker": 1, "kill-during-snapshot": 1, "node-loss": 1, "preemption": 1}


def scenario_env(name: str) -> dict[str, str]:
    return {"ELASTIC_FAULT": SCENARIO_FAULTS[name]} if name in SCENARIO_FAULTS else {}


def run_scenario(
    name: str,
    workdir: Path,
    data: Path,
    *,
    steps: int | None = None,
    backend: str = "c10d",
    endpoint: str | None = None,
    launcher: str = "ours",
    seed: int = 0,
    model_args: Sequence[str] = ("--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--batch-size", "8"),
    recipe_args: Sequence[str] = (),
    timeout: float = 300,
    network: VirtualNetwork | None = None,
    etcd: EtcdServer | None = None,
    recipe: Path | None = None,
) -> ScenarioResult:
    """Run one scenario to the end and judge it. With a `network` each agent runs on
    a host of its own; with `etcd` (a started member) an etcd-v3 job uses it, and
    may restart it. The caller owns both and closes them. `recipe_args` go to the
    recipe after the harness's own flags (e.g. `["--fsdp"]`: the model sharded with FSDP2);
    `recipe` is the GPT recipe (default: `find_recipe()`)."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
    if name in NEEDS_NETWORK and network is None:
        raise ValueError(f"the {name} scenario needs agents on hosts of their own (a network of namespaces)")
    if name in NEEDS_OWN_ETCD and (etcd is None or backend != "etcd-v3"):
        raise ValueError(f"the {name} scenario needs the etcd-v3 backend on an etcd the harness started")
    if etcd is not None and endpoint is None:
        endpoint = f"{network.gateway}:{etcd.port}" if network else etcd.endpoint
    rng = random.Random(seed)
    steps = steps or SCENARIO_STEPS.get(name, 40)
    ckpt = workdir / "ckpt"
    spec = JobSpec(
        workdir=workdir, backend=backend, endpoint=endpoint, launcher=launcher, nnodes=SCENARIO_NNODES.get(name, "2:3"),
        run_id=f"chaos-{name}-{uuid.uuid4().hex[:8]}",  # several jobs may share one etcd
        script_args=[
            "--data", str(data), "--max-steps", str(steps), "--eval-every", "0", "--ckpt-dir", str(ckpt),
            "--ckpt-every", "5", "--hang-timeout", "3", "--dropout", "0.1", *model_args,
            *SCENARIO_ARGS.get(name, []), *recipe_args,
        ],
        env=scenario_env(name), sample_log=workdir / "samples", network=network, etcd=etcd,
        script=recipe or find_recipe(),
    )
    with ChaosJob(spec) as job:
        if name not in LAUNCHES_ITSELF:
            job.start()
        expected = SCENARIOS[name](job, rng)
        codes = job.wait(timeout)
        ends = [r["step"] for r in job.records() if r["event"] == "end"]
        stops_at = SCENARIO_STOPS_AT.get(name)
        final_step = steps if stops_at is None else stops_at
        final, error = verified_final_checkpoint(ckpt, final_step) if ckpt.is_dir() else (None, "no checkpoint directory")
        if ckpt.is_dir() and any(p.name.startswith(".tmp.") for p in ckpt.iterdir()):
            final, error = None, f"a failed save left its temporary directory in {ckpt}"
        return ScenarioResult(
            scenario=name,
            exit_codes=codes,
            expected_codes=expected,
            end_step=ends[-1] if ends else None,
            max_steps=steps,
            recovery_seconds=[job.recovery_seconds(t) for _, t in job.faults],
            final_checkpoint=final,
            checkpoint_error=error,
            samples=audit(workdir / "samples"),
            stops_at=stops_at,
            redone=[r["redone"] for r in job.records() if r["event"] == "restore" and r.get("restart", 0) > 0 and "redone" in r],
            max_redone=SCENARIO_MAX_REDONE.get(name) if launcher == "ours" else None,
            logs=job.logs(),
            report=draw_report(job.events_path, workdir / "report.png", title=f"chaos: {name} ({' '.join([backend, *recipe_args])})"),
        )
