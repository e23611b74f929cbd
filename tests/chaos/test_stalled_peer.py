"""A peer that stalls while the job restores from it (#40): the restore goes on to the next
source within its deadline, and the job completes; it never runs past the deadline (exit 75).

A real two-node `torchrevive-run` job (the chaos harness), snapshots every step. Rank 0's
copies in its own node's memory are gone (only the other node's replica of its part is left),
its worker is killed, and while the restarted group is about to read the snapshot the other
node's agent, whose keeper holds that replica, is SIGSTOPped (a frozen host: connections are
accepted by the kernel, nothing is answered). Rank 0's fetch gets its share of the fetch time,
then the group restores from disk, and the job trains on to its last step.
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pytest
import warm
from references import TINY_GPT
from support import wait_for

from elastic._agent.launcher.keeper_files import private_directory
from elastic._agent.launcher.proctree import descendants
from elastic._shared.storage import parts
from elastic._shared.storage.keeper_address import LOCAL, REPLICA
from elastic._worker.observe.events import read_events
from elastic.chaos.harness import ChaosJob, JobSpec

pytestmark = pytest.mark.slow

STEPS = 30
HOLD_AFTER = 12
RESTORE_TIMEOUT = 30
"""--ckpt-restore-timeout: fetching from other nodes gets half of it; the disk has the rest."""


def test_a_stalled_peer_keeper_leads_to_the_disk_within_the_restore_deadline(tmp_path: Path, tiny_corpus: Path) -> None:
    held, go = tmp_path / "hold-after-step", [tmp_path / f"go-{rank}" for rank in (0, 1)]
    faults = [f"after_step@{HOLD_AFTER}:do=hold:until={held}"]  # rank 0, first group: the job stands still
    # The restarted group: each rank holds once it knows where every part is, before reading any.
    faults += [f"before_read@0+:rank={rank}:restart=1:do=hold:until={go[rank]}" for rank in (0, 1)]
    spec = JobSpec(
        workdir=tmp_path, nnodes="2:3", run_id=f"stalled-{uuid.uuid4().hex[:8]}", start_process=warm.popen,
        script_args=[
            "--data", str(tiny_corpus), "--max-steps", str(STEPS), "--eval-every", "0", "--ckpt-dir", str(tmp_path / "ckpt"),
            "--ckpt-every", "5", "--snapshot-every", "1", "--ckpt-restore-timeout", str(RESTORE_TIMEOUT), *TINY_GPT,
        ],
        env={"ELASTIC_FAULT": ",".join(faults)},
    )
    with ChaosJob(spec) as job:
        job.start()
        wait_for(lambda: Path(f"{held}.held").exists(), 240, f"rank 0 to hold after step {HOLD_AFTER}")
        agents = job.agents
        node_of = {rank: next(i for i, a in enumerate(agents) if pid in descendants(a.pid)) for rank, pid in job.workers().items()}
        # Agent 0 hosts the c10d stores; the other one is the peer that stalls.
        assert node_of == {0: 0, 1: 1}, f"ranks on other agents than expected: {node_of}\n{job.logs()}"
        memory = [next(private_directory(job.snapshot_base).glob(f"*-{a.pid}-*")) for a in agents]

        def settled() -> bool:  # step HOLD_AFTER's parts and replicas all written
            have = {(where, i, h.rank) for i, d in enumerate(memory) for where in (LOCAL, REPLICA)
                    for h in parts.read_headers(d / where) if h.step == HOLD_AFTER}
            return {(LOCAL, 0, 0), (LOCAL, 1, 1), (REPLICA, 1, 0), (REPLICA, 0, 1)} <= have

        wait_for(settled, 120, f"step {HOLD_AFTER}'s snapshot parts and replicas")
        for part in (memory[0] / LOCAL).iterdir():  # rank 0's part now lies only in the peer's memory
            part.unlink()
        job.signal_worker(signal.SIGKILL, rank=0)
        wait_for(lambda: all(Path(f"{g}.held").exists() for g in go), 240, "the restarted group to be about to read")
        os.kill(agents[1].pid, signal.SIGSTOP)  # its keeper, the one holder of rank 0's part, answers nothing now
        try:
            for g in go:
                g.touch()

            def restored() -> dict | None:  # {}: agent 0 ended first
                found = next((e for e in job.records() if e["event"] == "restore" and e.get("restart", 0) > 0), None)
                return found if found is not None else ({} if agents[0].poll() is not None else None)

            restore = job.poll_for(restored, 240, "the restarted group's restore")
        finally:
            os.kill(agents[1].pid, signal.SIGCONT)
        if not restore:
            pytest.fail(f"agent 0 exited {agents[0].poll()} before its group restored (75: past the restore's deadline)\n"
                        f"{job.logs(tail=20000)}")
        codes = job.wait(300)
        logs = job.logs(tail=20000)
    assert codes == [0, 0], f"exit codes {codes} (75: the restore ran past its deadline)\n{logs}"
    assert restore["source"] == "disk", restore
    assert "cannot be restored" in logs and "no keeper could send" in logs, logs
    ends = [e["step"] for e in read_events(tmp_path / "events.jsonl") if e["event"] == "end"]
    assert ends and ends[-1] == STEPS, ends
