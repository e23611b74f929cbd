"""A worker that stops making progress (SIGSTOP, deadlock) is detected and the job goes on."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import warm
from support import REPO, TINY_MODEL, standalone_command, worker_env

from elastic._worker.control.watchdog import EXIT_CODE
from elastic._worker.observe.events import read_events

pytestmark = pytest.mark.slow

# torch's agent logs each failed round of workers once, naming the first worker it saw exit:
# "E1123 19:19:52.198000 6375 .../multiprocessing/api.py:836] failed (exitcode: 124) local_rank: 0
# (pid: 6436) of fn: run_script_path (start_method: forkserver)" ("of binary: ..." without warm start).
# Matched by its own structure, not by ^: a log record is one write, but the workers' unbuffered
# stderr may leave half a line (a stack dump's) just before it.
AGENT_FAILURE = re.compile(r"api\.py:\d+\] failed \(exitcode: (-?\d+)\) local_rank: \d+ \(pid: \d+\) of (?:fn|binary): ")
# The watchdog's message (one write; its newline may come after another worker's output).
WATCHDOG_TRIP = re.compile(
    r"watchdog: no training step completed for \d+ s after step \d+ \(limit 3 s\): [^\n]*"
    rf"exiting with status {EXIT_CODE} so torchrun restarts the group"
)


def test_a_stopped_then_a_deadlocked_worker_are_each_named_and_ended_and_the_job_completes(
    tmp_path: Path, tiny_corpus: Path
) -> None:
    """One job, two hangs: rank 1 SIGSTOPped after step 12, then (in the restarted group) blocked in
    its main thread for good after step 20. Each time the ranks name rank 1 before the watchdog's
    limit, its agent ends it, the group resumes from memory at most one step back, and the job
    completes."""
    events = tmp_path / "events.jsonl"
    args = [
        "--data", str(tiny_corpus), "--max-steps", "30", "--eval-every", "0", "--events", str(events),
        "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "5", "--hang-timeout", "3",
        "--collective-timeout", "600",  # far away: only the watchdog can end the hang
        "--snapshot-every", "1",  # not the auto interval: at most one step redone is what this checks
        *TINY_MODEL,
    ]
    done = warm.run(
        # Our launcher: its reaper ends the SIGSTOPped worker when the group stops, where
        # stock torchrun waits 30 s for it to act on SIGTERM.
        standalone_command(2, args, max_restarts=2, launcher="elastic._agent.launcher"),
        timeout=240, cwd=REPO,
        env=worker_env(ELASTIC_FAULT="after_step@12:rank=1:do=stop,after_step@20:rank=1:do=hang:restart=1"),
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    # One failed round per hang (the job succeeded). Each hang is named (below), and the agent of the
    # culprit's node ends it (SIGKILL, a stopped one too) at once: rank 0's collective then fails
    # ("Connection closed by peer" or a reset: exit 1), unless its watchdog (124) came first on a slow
    # machine. torch names the failure with the smallest timestamp: either may be named.
    ended = re.findall(r"torchrevive-run: ending worker rank 1 \(pid \d+\), the hang's culprit", output)
    assert len(ended) == 2, output[-4000:]
    failures = AGENT_FAILURE.findall(output)
    assert len(failures) == 2, output[-4000:]
    assert set(failures) <= {str(EXIT_CODE), "1", "-9"}, output[-4000:]
    recorded = list(read_events(events))
    restores = [e for e in recorded if e["event"] == "restore"]
    # In-memory snapshots every step (our launcher): the group resumes at the hang's step, or one
    # before when rank 1 froze before its snapshot of that step was whole.
    assert [(e["source"], e["step"], e["redone"] <= 1) for e in restores] in (
        [("memory", first, True), ("memory", second, True)] for first in (11, 12) for second in (19, 20)
    ), restores
    assert [e["step"] for e in recorded if e["event"] == "end"] == [30]
    # Each hang is named before the watchdog ends the group: rank 1, once silent (stopped), once blocked in
    # Python (its stack top in the fault's wait), the others waiting in the next step's collectives.
    hangs = [e for e in recorded if e["event"] == "hang"]
    assert [h["culprits"] for h in hangs] == [[1], [1]], hangs
    stopped, blocked = hangs
    assert stopped["reasons"][0].startswith("no answer") and stopped["collective"] in (
        "train step at step 13", "step vote at step 12"), stopped
    assert blocked["reasons"][0].startswith("never entered it") and "faults.py" in blocked["stack_tops"][0], blocked
    assert blocked["collective"] == "train step at step 21" and blocked["step"] == 21, blocked
    assert all(h["nodes"][0] and h["hosts"][0] for h in hangs), hangs
    lines = re.findall(r"torchrevive-run: hang: the job waits in [^\n]* for rank 1 on node [^\n]*", output)
    assert len(lines) == 2 and "never entered it" in lines[1], output[-4000:]
    # named before the watchdog would trip (a fifth of --hang-timeout, then as long to compare), and
    # the culprit ended on that name: the line precedes its ending and any watchdog's line
    trips = WATCHDOG_TRIP.findall(output)
    assert output.index(lines[0]) < output.index(ended[0]), output[-4000:]
    assert not trips or output.index(lines[0]) < output.index(trips[0]), output[-4000:]
    # and every failure of the job in the event log, by the agent: rank, node, host, how, step, error
    failures = [e for e in recorded if e["event"] == "failure"]
    assert len(failures) >= 2 and all(f["node"] and f["host"] and f["error"] for f in failures), failures
    assert {f["exitcode"] for f in failures} <= {EXIT_CODE, 1, -9}, failures
    assert [f["error"] for f in failures if f["rank"] == 1] == ["ended as a hang's culprit"] * 2, failures
    assert not [e for e in recorded if e["event"] in ("node_excluded", "crash_loop")]


def test_a_hang_without_snapshots_resumes_from_the_newest_checkpoint(tmp_path: Path, tiny_corpus: Path) -> None:
    """The same stopped worker with snapshots off: the newest checkpoint on disk before the hang."""
    events = tmp_path / "events.jsonl"
    args = [
        "--data", str(tiny_corpus), "--max-steps", "30", "--eval-every", "0", "--events", str(events),
        "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "5", "--hang-timeout", "3", "--snapshot-every", "0",
        "--collective-timeout", "600", *TINY_MODEL,
    ]
    done = warm.run(
        standalone_command(2, args, max_restarts=1, launcher="elastic._agent.launcher"),
        timeout=240, cwd=REPO,
        env=worker_env(ELASTIC_FAULT="after_step@12:rank=1:do=stop"),
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    recorded = list(read_events(events))
    restores = [e for e in recorded if e["event"] == "restore"]
    # The newest checkpoint committed before the hang: 10, or 5 when slow storage skipped 10.
    # Rank 0 reports a commit when it next looks (its "checkpoint" event), and a hang can come
    # first: step 10's save, written by both ranks' writer threads, may commit unreported.
    before = [e["step"] for e in recorded if e["event"] == "checkpoint" and e["restart"] == 0 and e["step"] <= 12]
    assert restores and before, "resumed from a checkpoint"
    assert before[-1] <= restores[-1]["step"] <= 12 and restores[-1]["step"] % 5 == 0, "from the newest before the hang"
    assert [e["step"] for e in recorded if e["event"] == "end"] == [30]


def test_more_faults_than_max_restarts_fail_with_a_summary_and_a_good_checkpoint(tmp_path: Path, tiny_corpus: Path) -> None:
    ckpt = tmp_path / "ckpt"
    args = [
        "--data", str(tiny_corpus), "--max-steps", "40", "--eval-every", "0", "--ckpt-dir", str(ckpt),
        "--ckpt-every", "5", *TINY_MODEL,
    ]
    command = [sys.executable, "-m", "elastic._agent.launcher", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
               "--monitor-interval=0.5", str(REPO / "recipes" / "gpt.py"), *args]
    done = warm.run(command, timeout=240, cwd=REPO,
                          # @12+: a restart resumes from memory at step 11 or 12 and must die again.
                          env=worker_env(ELASTIC_FAULT="after_step@12+:rank=1:restart=any"))
    assert done.returncode != 0
    last_line = done.stderr.strip().splitlines()[-1]
    # Warm workers of one node are watched together: the agent names the first it saw
    # dead, the killed rank 1 or rank 0 whose collective failed a moment later.
    assert re.match(r"torchrevive-run: job failed: worker rank (1 killed by SIGKILL|0 exit status 1), ", last_line), last_line
    assert "--max-restarts=1" in last_line
    inspect = warm.run([sys.executable, "-m", "elastic.checkpoint", "inspect", str(ckpt)], timeout=60, cwd=REPO)
    assert inspect.returncode == 0, inspect.stdout + inspect.stderr
    # The newest good checkpoint is the periodic step 10 or, newer, the step the keeper
    # persisted from memory at the breakpoint (11 to 13); a loaded machine may skip step 10.
    latest = re.search(r"latest -> step_(\d+); (\d+) of (\d+) verify", inspect.stdout)
    assert latest, inspect.stdout
    assert 10 <= int(latest.group(1)) <= 13, inspect.stdout
    assert latest.group(2) == latest.group(3), inspect.stdout
