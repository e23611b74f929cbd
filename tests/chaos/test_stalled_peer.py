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
from pathlib import Path

import pytest
import warm
from peer_restore import (
    go_files,
    job_spec,
    node_memory,
    only_on_peers,
    restart_restore,
    wait_settled,
)
from support import wait_for

from elastic._worker.observe.events import read_events
from elastic.chaos.harness import ChaosJob

pytestmark = pytest.mark.slow

STEPS = 30
HOLD_AFTER = 12
RESTORE_TIMEOUT = 30
"""--ckpt-restore-timeout: fetching from other nodes gets half of it; the disk has the rest."""


def test_a_stalled_peer_keeper_leads_to_the_disk_within_the_restore_deadline(tmp_path: Path, tiny_corpus: Path) -> None:
    held, go = tmp_path / "hold-after-step", go_files(tmp_path)
    spec = job_spec(tmp_path, tiny_corpus, name="stalled", steps=STEPS, restore_timeout=RESTORE_TIMEOUT,
                    faults=[f"after_step@{HOLD_AFTER}:do=hold:until={held}"],  # rank 0, first group: the job stands still
                    start_process=warm.popen)
    with ChaosJob(spec) as job:
        job.start()
        wait_for(lambda: Path(f"{held}.held").exists(), 240, f"rank 0 to hold after step {HOLD_AFTER}")
        agents = job.agents
        memory = node_memory(job)  # agent 0 hosts the c10d stores; the other one is the peer that stalls
        wait_settled(memory, HOLD_AFTER, f"step {HOLD_AFTER}'s snapshot parts and replicas")
        only_on_peers(memory[:1])  # rank 0's part now lies only in the peer's memory
        job.signal_worker(signal.SIGKILL, rank=0)
        wait_for(lambda: all(Path(f"{g}.held").exists() for g in go), 240, "the restarted group to be about to read")
        os.kill(agents[1].pid, signal.SIGSTOP)  # its keeper, the one holder of rank 0's part, answers nothing now
        try:
            for g in go:
                g.touch()

            def restored() -> dict | None:  # {}: agent 0 ended first
                found = restart_restore(job)
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
