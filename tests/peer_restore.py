"""A restore that must fetch from the other node's memory: the setup the stalled-peer and the
idle-connections chaos tests share (tests/chaos/test_stalled_peer.py, test_keeper_denial_job.py).

A real two-node job with snapshots every step; rank 0 holds after `hold_after` (`hold`), the test
waits until that step's parts and their replicas on the other node are written (`settled`), removes
each node's own parts (`only_on_peers`), kills rank 0, and the restarted group holds before reading
(`go` files) while the test does to the peers what it means to."""

from __future__ import annotations

import uuid
from pathlib import Path

from references import TINY_GPT
from support import wait_for

from elastic._agent.launcher.keeper_files import private_directory
from elastic._agent.launcher.proctree import descendants
from elastic._shared.storage import parts
from elastic._shared.storage.keeper_address import LOCAL, REPLICA
from elastic.chaos.harness import ChaosJob
from elastic.chaos.job_spec import JobSpec


def go_files(workdir: Path) -> list[Path]:
    """What the restarted group's ranks each wait for before reading any part."""
    return [workdir / f"go-{rank}" for rank in (0, 1)]


def job_spec(workdir: Path, corpus: Path, *, name: str, steps: int, restore_timeout: int, faults: list[str],
             start_process) -> JobSpec:
    """The two-node job: `faults` first, then each restarted rank holding before it reads (on any attempt:
    the first group reads nothing, and a survivor's agent that restarts for the failed node's rejoin
    rather than for its own worker's failure starts its workers at restart count 0)."""
    holds = [f"before_read@0+:rank={rank}:restart=any:do=hold:until={go}" for rank, go in enumerate(go_files(workdir))]
    return JobSpec(
        workdir=workdir, nnodes="2:3", run_id=f"{name}-{uuid.uuid4().hex[:8]}", start_process=start_process,
        script_args=[
            "--data", str(corpus), "--max-steps", str(steps), "--eval-every", "0", "--ckpt-dir", str(workdir / "ckpt"),
            "--ckpt-every", "5", "--snapshot-every", "1", "--ckpt-restore-timeout", str(restore_timeout), *TINY_GPT,
        ],
        env={"ELASTIC_FAULT": ",".join([*faults, *holds])},
    )


def node_memory(job: ChaosJob) -> list[Path]:
    """Each agent's snapshot directory, once rank r is known to run under agent r (agent 0 hosts the stores)."""
    agents = job.agents
    node_of = {rank: next(i for i, a in enumerate(agents) if pid in descendants(a.pid))
               for rank, pid in job.workers().items()}
    assert node_of == {0: 0, 1: 1}, f"ranks on other agents than expected: {node_of}\n{job.logs()}"
    return [next(private_directory(job.snapshot_base).glob(f"*-{a.pid}-*")) for a in agents]


def wait_settled(memory: list[Path], step: int, what: str) -> None:
    """Until `step`'s parts and their replicas on the other node are all written."""

    def settled() -> bool:
        have = {(where, i, h.rank) for i, d in enumerate(memory) for where in (LOCAL, REPLICA)
                for h in parts.read_headers(d / where) if h.step == step}
        return {(LOCAL, 0, 0), (LOCAL, 1, 1), (REPLICA, 1, 0), (REPLICA, 0, 1)} <= have

    wait_for(settled, 120, what)


def only_on_peers(directories: list[Path]) -> None:
    """Remove these nodes' own parts: what they held now lies only in the other node's memory."""
    for directory in directories:
        for part in (directory / LOCAL).iterdir():
            part.unlink()


def restart_restore(job: ChaosJob) -> dict | None:
    """The restarted group's restore event, once written."""
    return next((e for e in job.records() if e["event"] == "restore" and e.get("restart", 0) > 0), None)
