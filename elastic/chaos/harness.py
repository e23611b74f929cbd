"""Run an elastic job of several torchrun agents on this machine and hurt it.

`ChaosJob` starts the N agents of one job (a `JobSpec`, job_spec.py; the GPT recipe by default) under
`elastic._agent.launcher` or stock torchrun, with c10d or etcd-v3 rendezvous, on
loopback or each on a host of its own (`elastic.chaos.netns`), and offers the
faults a cluster deals out: SIGKILL a worker, SIGKILL a whole agent with its
workers (node loss), a new agent joining (scale up), SIGSTOP a worker (a
hang), SIGTERM a worker (preemption), a cut network link (partition), an etcd
that stops and comes back. Faults that must strike at an exact point inside a
worker (just before a checkpoint commits) go through `ELASTIC_FAULT` (see
`elastic.chaos.faults`).

The scenarios (elastic.chaos.scenarios) use it: each starts a job, injects its
fault once training is under way, waits for the end, and returns a
`ScenarioResult`: exit codes, the recovery time (fault -> first completed step
of the restarted group, from the event log: verdict.py), whether the final checkpoint
verifies, and the exactly-once audit of the samples trained on
(`elastic.chaos.samples`).

Invariant: every process it starts is killed, and every cable it cut is
plugged back, when the job is closed, whatever happened. The network and the
etcd a job uses belong to the caller.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from elastic._agent.launcher.keeper_files import BASE_ENV as SNAPSHOT_BASE_ENV
from elastic._agent.launcher.keeper_files import private_directory
from elastic._agent.launcher.proctree import descendants, worker_rank
from elastic._shared.storage.peer_auth import SECRET_FILE_ENV
from elastic.chaos.job_spec import JobSpec, find_recipe
from elastic.chaos.netns import INTERFACE, free_port
from elastic.chaos.samples import LOG_ENV as SAMPLE_LOG_ENV
from elastic.chaos.verdict import recovery_phases, recovery_seconds, torch_log_times

logger = logging.getLogger(__name__)


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
        self.agents: list[Any] = []  # subprocess.Popen, or what JobSpec.start_process gives
        self.faults: list[tuple[str, float]] = []

    def host_address(self, index: int) -> str:
        return self.spec.network.address(index) if self.spec.network else "127.0.0.1"

    def command(self, index: int) -> list[str]:
        """Agent `index`'s command line (on its own host when the job has a network)."""
        launcher = ["-m", "elastic._agent.launcher"] if self.spec.launcher == "ours" else ["-m", "torch.distributed.run"]
        rdzv_conf = self.spec.rdzv_conf
        if self.spec.backend == "c10d":
            # The agent that hosts c10d's rendezvous store is the one node a c10d job cannot
            # lose: make it host 0's, always. Said outright (torch would guess from the
            # hostname, which every agent here shares, and take whichever binds first), so
            # every agent can start at once: the others connect as clients and wait for it.
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
        # As on several hosts: the job's secret in a file every agent is given (docs/security.md).
        env.setdefault(SECRET_FILE_ENV, str(self.secret_file()))
        env.update(self.spec.env)
        return env

    def secret_file(self) -> Path:
        """The job's snapshot secret (made once, mode 0600), as an operator hands it to every node."""
        path = self.spec.workdir / "snapshot-secret"
        if not path.exists():
            path.touch(mode=0o600)
            path.write_text(secrets.token_hex(32))
        return path

    @property
    def snapshot_base(self) -> Path:
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else self.spec.workdir
        return base / f"chaos-{self.spec.run_id}"

    def wipe_node_memory(self, pid: int) -> None:
        """What a node loss takes with it: the shared memory of the agent `pid`'s snapshot keeper."""
        for directory in private_directory(self.snapshot_base).glob(f"*-{pid}-*"):
            shutil.rmtree(directory, ignore_errors=True)

    def add_agent(self, host: int | None = None) -> Any:
        """Start one more agent (the first ones, or a node joining later), on host
        `host` (default: a host of its own; a relaunch reuses the first ones)."""
        index = len(self.agents)
        host = index if host is None else host
        if self.spec.network is not None and self.spec.network.hosts <= host:
            self.spec.network.add_host()
        with open(self.spec.workdir / f"agent{index}.log", "wb") as log:
            env = {**self.environment(), **self.spec.agent_env.get(index, {})}
            agent = self.spec.start_process(self.command(host), stdout=log, stderr=subprocess.STDOUT, env=env)
        self.agents.append(agent)
        return agent

    def start(self) -> ChaosJob:
        for _ in range(self.spec.agents):
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
        for host in range(self.spec.agents):
            self.add_agent(host=host)

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
        return self.poll_for(lambda: self.recovery_seconds(fault_time), timeout, "a recovery from the fault")

    def live_agents(self) -> int:
        return sum(agent.poll() is None for agent in self.agents)

    def last_live_agent(self) -> int:
        """The index of the newest agent still running, never agent 0 (with c10d it hosts the rendezvous store)."""
        return max(i for i, agent in enumerate(self.agents) if i > 0 and agent.poll() is None)

    def poll_for(self, found: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
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
        self.poll_for(lambda: True if self.last_step(after) >= step else None, timeout, f"step {step}", interval=0.01)

    def wait_for_world_size(self, world_size: int, after: float, timeout: float = 180) -> float:
        """Wait for a step trained at `world_size` after time `after`; returns its time."""

        def step_time() -> float | None:
            return next(
                (r["time"] for r in self.records()
                 if r["event"] == "step" and r["world_size"] == world_size and r["time"] > after),
                None,
            )

        return self.poll_for(step_time, timeout, f"step at world size {world_size}")

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

    # --- verdicts (verdict.py) -------------------------------------------------------

    def recovery_seconds(self, fault_time: float) -> float | None:
        """Fault -> first step of a group started, or healed in place, after it (None: none yet)."""
        return recovery_seconds(self.records(), fault_time)

    def recovery_phases(self, fault_time: float) -> dict[str, float] | None:
        """Where a recovery's time went, in seconds after the fault (`verdict.recovery_phases`)."""
        return recovery_phases(self.records(), self.agent_log_times(), fault_time)

    def agent_log_times(self) -> list[tuple[float, str]]:
        """(unix time, line) of every timestamped line torch logged in the agents' logs."""
        return torch_log_times(self.agent_log(index) for index in range(len(self.agents)))

    def restart_times(self) -> list[float]:
        """When each worker group after the first started (from its 'start' event)."""
        return [r["time"] for r in self.records() if r["event"] == "start"][1:]
