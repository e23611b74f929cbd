"""Slow ranks on real jobs of agents (issue 43), two job starts. The first: two agents, one node at half speed
(tests/slow_share_job.py sleeps 2 ms per sample there, 1 ms on the other), `--slow-ranks rebalance`.

1. The ranks rebalance: the slow node's rank gets the smaller share, through the real vote.
2. Once a checkpoint holds the shares, the fast node's worker is SIGKILLed: the agents restore it at
   the same world size, the shares come back with the sampler's state, and every step replayed from
   the checkpoint with the same shares has the loss bit for bit of the step trained before the kill.
3. Then the slow node is lost (its agent and worker SIGKILLed): the job resumes at one rank, whose
   share is the whole global batch (shares hold only at the world size they were made for).

The sample audit finds every sample of the final history trained exactly once across all of it.
The second: a rank past --evict-factor under --survivors train-on is evicted with its node.
"""

from __future__ import annotations

import json
import signal
import time
import uuid
from pathlib import Path

import pytest
import warm
from support import REPO

from elastic._agent.launcher.failure_policy import SET_ASIDE_EXIT
from elastic._shared.protocol.exit_status import EVICTED_EXIT
from elastic.chaos.harness import ChaosJob
from elastic.chaos.job_spec import JobSpec
from elastic.chaos.samples import audit

pytestmark = pytest.mark.slow

BATCH, STEPS = 8, 250
REPLAY = 5
"""Steps the kill lands after a checkpoint: each is trained twice, before the kill and after the restore."""


def per_rank_counts(prefix: Path) -> dict[tuple[str, int], dict[int, int]]:
    """(round, step) -> {rank: samples trained}, from the sample log's raw records."""
    counts: dict[tuple[str, int], dict[int, int]] = {}
    for path in sorted(prefix.parent.glob(prefix.name + ".rank*")):
        rank = int(path.name.rsplit("rank", 1)[1])
        for line in path.read_text().splitlines():
            record = json.loads(line) if line.strip() else {}
            if "indices" in record:
                counts.setdefault((record["round"], record["step"]), {})[rank] = len(record["indices"])
    return counts


def steady_checkpoint(job: ChaosJob, after_step: int) -> int:
    """The step of the first checkpoint past `after_step` that the job trained REPLAY steps beyond
    without splitting the batch again (waits until it has). On a loaded machine the vote may split
    again at any step; a kill after such a split would replay fewer steps with the checkpoint's shares
    than the comparison needs (CI: a split 3 steps after the checkpoint, then the kill)."""
    while True:
        saved = job.poll_for(lambda: next((e["step"] for e in job.records() if e["event"] == "checkpoint"
                                           and e["step"] > after_step), None), 120, "a checkpoint of the shares")
        job.wait_for_step(saved + REPLAY)
        if not [e for e in job.records() if e["event"] == "rebalance" and e["step"] > saved]:
            return saved
        after_step = saved


def test_rebalanced_shares_survive_a_kill_bit_for_bit_and_a_resize_each_sample_once(tmp_path: Path) -> None:
    spec = JobSpec(
        workdir=tmp_path, nnodes="1:2", agents=2, start_process=warm.popen, run_id=f"shares-{uuid.uuid4().hex[:8]}",
        script=REPO / "tests" / "slow_share_job.py", sample_log=tmp_path / "samples",
        script_args=["--max-steps", str(STEPS), "--batch-size", str(BATCH), "--slow-ranks", "rebalance",
                     "--slow-window", "2", "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "10",
                     "--ckpt-keep", "100", "--snapshot-every", "0", "--hang-timeout", "60"],
        env={"SLOW_SHARE_MS_PER_SAMPLE": "1"}, agent_env={1: {"SLOW_SHARE_MS_PER_SAMPLE": "2"}},
    )
    with ChaosJob(spec) as job:
        job.start()
        first = job.poll_for(lambda: next((e for e in job.records() if e["event"] == "rebalance"), None), 120,
                             "a rebalance")
        saved = steady_checkpoint(job, after_step=first["step"] + 10)
        killed_at = time.time()
        job.signal_worker(signal.SIGKILL, rank=0)
        restored = job.poll_for(lambda: next((e for e in job.records() if e["event"] == "restore"
                                              and e["time"] > killed_at), None), 180, "the restore")
        job.wait_for_step(restored["step"] + 30, after=restored["time"])
        lost_at = time.time()
        job.kill_agent(1)
        job.wait_for_world_size(1, after=lost_at)
        codes = job.wait(timeout=300)
        recorded = job.records()
    assert codes[0] == 0, job.logs()

    rebalances = [e for e in recorded if e["event"] == "rebalance"]
    shares = rebalances[0]["shares"]
    assert len(shares) == 2 and sum(shares) == 2 * BATCH and min(shares) < BATCH, rebalances
    # 2. the restore at two ranks: from a checkpoint that holds the shares in effect before the kill
    assert restored["world_size"] == 2 and restored["step"] >= saved, restored
    # The shares the checkpoint holds: the last split taken at or before its step.
    in_effect = [e for e in rebalances if e["time"] < killed_at and e["step"] <= restored["step"]][-1]["shares"]
    counts = per_rank_counts(tmp_path / "samples")
    after_restore = sorted((step, by_rank) for (_, step), by_rank in counts.items() if step == restored["step"] + 1)
    assert len(after_restore) == 2, after_restore  # the step trained before the kill and again after the restore
    for _, by_rank in after_restore:
        assert sorted(by_rank.values()) == sorted(in_effect), (by_rank, in_effect)
    # Every step replayed from the checkpoint while both runs trained it with the same shares: the loss of the
    # uninterrupted run, bit for bit. (The vote splits by measured speed: on a loaded machine either run may
    # split again at a step of its own, in the suite 3 steps after the checkpoint. The comparison ends at the
    # first step the two trained with other shares; the step after the checkpoint always has its shares.)
    steps = [e for e in recorded if e["event"] == "step" and "loss" in e]
    before = {e["step"]: e["loss"] for e in steps if e["time"] < killed_at and e["step"] > restored["step"]}
    after = {e["step"]: e["loss"] for e in steps if e["time"] > restored["time"]}
    replayed = []
    for step in sorted(set(before) & set(after)):
        trained = [by_rank for (_, at), by_rank in counts.items() if at == step]
        if len(trained) != 2 or trained[0] != trained[1]:
            break
        replayed.append(step)
    assert replayed[:1] == [restored["step"] + 1], (replayed, before, restored, rebalances)
    assert [before[s] for s in replayed] == [after[s] for s in replayed], replayed
    # 3. the resize: one rank takes the whole global batch of its world size
    resumed = [e for e in recorded if e["event"] == "restore" and e["time"] > lost_at]
    assert [e["world_size"] for e in resumed] == [1], resumed
    last = max(step for (_, step) in counts)
    assert list(counts[next(k for k in counts if k[1] == last)].values()) == [BATCH]
    ends = [e for e in recorded if e["event"] == "end"]
    assert [(e["step"], e["world_size"]) for e in ends] == [(STEPS, 1)], ends
    samples = audit(tmp_path / "samples")
    assert samples.ok and (samples.first_step, samples.last_step) == (1, STEPS), samples.summary()


def test_a_rank_past_the_evict_factor_leaves_with_its_node_and_the_survivor_trains_on_each_sample_once(
    tmp_path: Path,
) -> None:
    """Two agents under --survivors train-on, one node six times slower than the other, `--slow-ranks evict`
    (--evict-factor 3): every rank names it at one vote, its worker exits 82, its agent sets the node aside
    and leaves (79), and the other trains on alone to the last step, every sample once."""
    steps = 150
    spec = JobSpec(
        workdir=tmp_path, nnodes="1:2", agents=2, start_process=warm.popen, run_id=f"evict-{uuid.uuid4().hex[:8]}",
        script=REPO / "tests" / "slow_share_job.py", sample_log=tmp_path / "samples",
        script_args=["--max-steps", str(steps), "--batch-size", str(BATCH), "--slow-ranks", "evict",
                     "--slow-window", "2", "--snapshot-every", "0", "--hang-timeout", "60",
                     "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "0"],  # its writer's claim here, not in the cwd
        env={"SLOW_SHARE_MS_PER_SAMPLE": "1", "TORCHREVIVE_SURVIVORS": "train-on",
             "TORCHREVIVE_SET_ASIDE_COOL_OFF": "5"},
        agent_env={1: {"SLOW_SHARE_MS_PER_SAMPLE": "6"}},
    )
    with ChaosJob(spec) as job:
        job.start()
        codes = job.wait(timeout=300)
        recorded = job.records()
        slow_log = job.agent_log(1)
    assert codes == [0, SET_ASIDE_EXIT], job.logs()
    evicted = [e for e in recorded if e["event"] == "straggler_evicted"]
    assert len(evicted) == 1 and evicted[0]["action"] == "evicted" and evicted[0]["slowdown"] >= 3, evicted
    named = next(e for e in recorded if e["event"] == "straggler")
    assert (named["rank"], named["node"]) == (evicted[0]["rank"], evicted[0]["node"])
    failures = [e for e in recorded if e["event"] == "failure" and e["primary"]]
    assert [(e["exitcode"], e["node"]) for e in failures] == [(EVICTED_EXIT, evicted[0]["node"])], failures
    excluded = [e for e in recorded if e["event"] == "node_excluded"]
    assert [e["node"] for e in excluded] == [evicted[0]["node"]] and "evicted as a straggler" in excluded[0]["reason"]
    assert f"is evicted at step {evicted[0]['step']}" in slow_log
    ends = [e for e in recorded if e["event"] == "end"]
    assert [(e["step"], e["world_size"]) for e in ends] == [(steps, 1)], ends
    samples = audit(tmp_path / "samples")
    assert samples.ok and (samples.first_step, samples.last_step) == (1, steps), samples.summary()
