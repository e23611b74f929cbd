"""A bad node is set aside and a crash loop stops (issue 42): two real torchrevive-run jobs, judged by
the chaos harness, each asserting everything it can show.

1. Three nodes (--nnodes 2:3). Node 1's worker crashes once, after step 4 (a one-off); node 2's crashes
   after its first step at every start from step 8 on. Node 2 is set aside after 3 failures (its agent
   exits 79 with one line), node 1 is not; the job trains on at two nodes and ends exactly-once.
2. Two nodes (--nnodes 2:2: the job cannot shrink). Rank 1 dies after step 15 on every attempt,
   which resumes from step 10's checkpoint, so every attempt dies after the same completed step: after 3
   attempts both agents stop with exit 78 and one line, with --max-restarts 10 left unspent.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest
import warm
from references import TINY_GPT

from elastic._agent.launcher.failure_policy import CRASH_LOOP_EXIT, SET_ASIDE_EXIT
from elastic.chaos.harness import ChaosJob
from elastic.chaos.job_spec import JobSpec
from elastic.chaos.samples import audit

pytestmark = pytest.mark.slow

MAX_RESTARTS = 10


def args(corpus: Path, workdir: Path, steps: int, *extra: str) -> list[str]:
    return ["--data", str(corpus), "--max-steps", str(steps), "--eval-every", "0", "--ckpt-dir", str(workdir / "ckpt"),
            *extra, *TINY_GPT]


def node_of(job: ChaosJob, index: int) -> str:
    """Agent `index`'s node name as its snapshot keeper and the event log name it (host-PID-...)."""
    pid = job.agents[index].pid
    names = {e["node"] for e in job.records() if e["event"] in ("failure", "node_excluded") and f"-{pid}-" in e["node"]}
    assert len(names) <= 1, names
    return names.pop() if names else f"-{pid}-"


def test_a_node_failing_at_every_start_is_set_aside_and_a_one_off_is_not(tmp_path: Path, tiny_corpus: Path) -> None:
    spec = JobSpec(
        workdir=tmp_path, nnodes="2:3", agents=3, max_restarts=MAX_RESTARTS, start_process=warm.popen,
        run_id=f"set-aside-{uuid.uuid4().hex[:8]}", sample_log=tmp_path / "samples",
        script_args=args(tiny_corpus, tmp_path, 30, "--ckpt-every", "5", "--snapshot-every", "1", "--hang-timeout", "20"),
        env={"TORCHREVIVE_SET_ASIDE_COOL_OFF": "5"},
        agent_env={1: {"ELASTIC_FAULT": "after_step@4:rank=any"},
                   2: {"ELASTIC_FAULT": "after_step@8+:rank=any:restart=any"}},
    )
    with ChaosJob(spec) as job:
        job.start()
        codes = job.wait(timeout=300)
        logs = [job.agent_log(i) for i in range(3)]
        recorded = job.records()
        bad, one_off = node_of(job, 2), node_of(job, 1)
    assert codes == [0, 0, SET_ASIDE_EXIT], (codes, job.logs())
    excluded = [e for e in recorded if e["event"] == "node_excluded"]
    assert len(excluded) == 1 and excluded[0]["node"] == bad and excluded[0]["failures"] == 3, excluded
    assert excluded[0]["host"] and "set aside" in excluded[0]["reason"]
    primaries = [e for e in recorded if e["event"] == "failure" and e["primary"]]
    assert [e["node"] for e in primaries].count(bad) == 3, primaries
    assert [e["node"] for e in primaries].count(one_off) == 1, primaries  # the one-off: counted, nobody set aside
    assert all(e["exitcode"] == -9 and "SIGKILL" in e["error"] or "Signal 9" in e["error"] for e in primaries), primaries
    assert all(e["rank"] >= 0 and e["host"] and e["step"] >= 3 for e in primaries), primaries
    # every agent printed every failure and the set-aside line; the set-aside agent said why, in one line
    for log in logs[:2]:
        assert re.search(rf"torchrevive-run: node {re.escape(bad)} is set aside: 3 failures", log), log[-3000:]
        assert log.count("torchrevive-run: failure: worker rank") >= 4, log[-3000:]
    assert logs[2].strip().splitlines()[-1].startswith(f"torchrevive-run: node {bad} is set aside"), logs[2][-2000:]
    assert "does not rejoin for 5 s" in logs[2]
    # the job trained on at two nodes to its end, each sample exactly once, without a crash-loop stop
    ends = [e for e in recorded if e["event"] == "end"]
    assert [(e["step"], e["world_size"]) for e in ends] == [(30, 2)], ends
    assert not [e for e in recorded if e["event"] == "crash_loop"]
    samples = audit(tmp_path / "samples")
    assert samples.ok, samples.summary()
    restarts = max(e["restart"] for e in recorded if e["event"] == "failure")
    assert restarts < MAX_RESTARTS


def test_a_crash_at_the_same_step_on_every_attempt_stops_after_three(tmp_path: Path, tiny_corpus: Path) -> None:
    spec = JobSpec(
        workdir=tmp_path, nnodes="2:2", agents=2, max_restarts=MAX_RESTARTS, start_process=warm.popen,
        run_id=f"crash-loop-{uuid.uuid4().hex[:8]}",
        script_args=args(tiny_corpus, tmp_path, 30, "--ckpt-every", "10", "--snapshot-every", "0", "--hang-timeout", "20"),
        env={"ELASTIC_FAULT": "after_step@15:rank=1:restart=any"},
    )
    with ChaosJob(spec) as job:
        job.start()
        codes = job.wait(timeout=300)
        logs = [job.agent_log(i) for i in range(2)]
        recorded = job.records()
    assert codes == [CRASH_LOOP_EXIT, CRASH_LOOP_EXIT], (codes, job.logs())
    primaries = [e for e in recorded if e["event"] == "failure" and e["primary"]]
    assert [(e["rank"], e["step"]) for e in primaries] == [(1, 14)] * 3, primaries
    loops = [e for e in recorded if e["event"] == "crash_loop"]
    assert len(loops) == 1 and (loops[0]["step"], loops[0]["rank"], loops[0]["attempts"]) == (14, 1, 3), loops
    assert loops[0]["exit_code"] == CRASH_LOOP_EXIT and loops[0]["error"]
    for log in logs:  # one line on every agent, its last: the step, the rank, the error, the status
        last = log.strip().splitlines()[-1]
        assert re.match(r"torchrevive-run: crash loop: the job failed 3 times in a row after step 14 .*rank 1 ", last), last
        assert f"exit status {CRASH_LOOP_EXIT}" in last
    assert not [e for e in recorded if e["event"] == "node_excluded"]  # at --nnodes MIN: no one to set aside
    assert max(e["restart"] for e in recorded if e["event"] == "failure") <= 3 < MAX_RESTARTS
    assert [e["step"] for e in recorded if e["event"] == "checkpoint"][-1] == 10
