"""In-memory snapshots on real torchrun jobs: on by default under our launcher, off with
one line under plain torchrun, and persisted by the keeper when a failure ends the job."""

from __future__ import annotations

import random
import re
import subprocess
from pathlib import Path

import pytest
import warm
from support import TINY_MODEL, make_text, standalone_command, worker_env

from elastic._worker.checkpoint import CheckpointStore
from elastic._worker.observe.events import read_events

pytestmark = pytest.mark.slow


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(make_text(random.Random(3), 20_000))
    return path


def job(
    tmp_path: Path, corpus: Path, *, launcher: str, steps: int, max_restarts: int, fault: str, ckpt_every: int = 5,
    snapshot_every: str = "1", extra: list[str] | None = None, **env: str,
) -> subprocess.CompletedProcess[str]:
    args = ["--data", str(corpus), "--max-steps", str(steps), "--eval-every", "0", "--ckpt-dir", str(tmp_path / "ckpt"),
            "--ckpt-every", str(ckpt_every), "--events", str(tmp_path / "ev.jsonl"), "--snapshot-every", snapshot_every,
            *TINY_MODEL, *(extra or [])]
    return warm.run(
        standalone_command(2, args, launcher=launcher, max_restarts=max_restarts),
        env=worker_env(ELASTIC_FAULT=fault, TORCHREVIVE_SNAPSHOT_BASE=str(tmp_path / "shm"), **env),
        timeout=240,
    )


def restores(tmp_path: Path) -> list[dict]:
    return [e for e in read_events(tmp_path / "ev.jsonl") if e["event"] == "restore"]


def test_under_plain_torchrun_a_failure_resumes_from_disk_and_says_why(tmp_path: Path, corpus: Path) -> None:
    done = job(tmp_path, corpus, launcher="torch.distributed.run", steps=14, max_restarts=1, fault="after_step@12:rank=1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "in-memory snapshots are off: no snapshot keeper runs on this node" in done.stderr
    # (Step 10's checkpoint may still be in flight at the kill: then step 5's is the newest.)
    assert [(r["source"], r["step"] in (5, 10)) for r in restores(tmp_path)] == [("disk", True)]


def test_a_failure_that_ends_the_job_leaves_the_newest_snapshot_on_disk(tmp_path: Path, corpus: Path) -> None:
    """No restarts left: the job ends at the kill, with --ckpt-every 50 nothing periodic was
    committed, yet the keeper wrote the newest snapshot; a new launch resumes from it."""
    failed = job(tmp_path, corpus, launcher="elastic._agent.launcher", steps=30, max_restarts=0, fault="after_step@12:rank=1",
                 ckpt_every=50)
    assert failed.returncode != 0
    store = CheckpointStore(tmp_path / "ckpt")
    committed = store.committed()
    assert len(committed) == 1, failed.stderr[-6000:]
    (newest,) = committed
    manifest = store.verify(newest)
    assert manifest.reason == "breakpoint" and manifest.step in (11, 12), manifest
    assert not [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".")]
    assert not list((tmp_path / "shm").glob("torchrevive-snapshots-*/*")), "the keeper left its shared memory behind"
    again = job(tmp_path, corpus, launcher="elastic._agent.launcher", steps=30, max_restarts=0, fault="", ckpt_every=50)
    assert again.returncode == 0, again.stderr[-3000:]
    (restore,) = restores(tmp_path)
    assert (restore["source"], restore["step"]) == ("disk", manifest.step)


def test_snapshots_off_under_our_launcher(tmp_path: Path, corpus: Path) -> None:
    """TORCHREVIVE_SNAPSHOTS=0: no keeper, and a failure resumes from disk as before."""
    done = job(tmp_path, corpus, launcher="elastic._agent.launcher", steps=14, max_restarts=1, fault="after_step@12:rank=1",
               TORCHREVIVE_SNAPSHOTS="0")
    assert done.returncode == 0, done.stderr[-3000:]
    # (Step 10's checkpoint may still be in flight at the kill: then step 5's is the newest.)
    assert [(r["source"], r["step"] in (5, 10)) for r in restores(tmp_path)] == [("disk", True)]
    # No keeper's files, and not the secret the agent made to sign with (one host, no secret given:
    # elastic._shared.storage.job_secret): the last process of the run here removes it at its exit.
    left = sorted(p.relative_to(tmp_path / "shm").parts for p in (tmp_path / "shm").rglob("*") if p.is_file())
    assert left == [], left


def test_auto_snapshots_agree_on_an_interval_and_a_failure_resumes_from_memory(tmp_path: Path, corpus: Path) -> None:
    """The default, auto, with failures expected every fraction of a second (--mtbf-hours): whatever the
    snapshots cost on this machine, Young/Daly's bound says every step, and every rank snapshots every step,
    so a kill after step 14 resumes from memory at step 14, or 13 when it cut rank 1's snapshot of 14 short
    (its header not written yet): the one step a kill can still make the job redo."""
    # A failure expected every 0.2 ms, below any snapshot's cost: Young/Daly's interval is then the MTBF itself, one
    # step however slow the machine. (At 0.0001 h, a loaded machine's snapshot cost 13 % of a step and the bound
    # said every 2 steps.)
    done = job(tmp_path, corpus, launcher="elastic._agent.launcher", steps=20, max_restarts=1, fault="after_step@14:rank=1",
               ckpt_every=6, snapshot_every="auto", extra=["--mtbf-hours", "0.0000001"])
    assert done.returncode == 0, done.stderr[-3000:]
    said = re.findall(r"in-memory snapshots every (\d+) step\(s\) \(--snapshot-every auto: a snapshot costs", done.stderr)
    # Said once per attempt, when first measured: every step from the start, never changed.
    assert said and set(said) == {"1"} and len(said) <= 2, done.stderr[-3000:]
    (restore,) = restores(tmp_path)
    assert restore["source"] == "memory" and restore["step"] in (13, 14), restore
    assert restore["redone"] == 14 - restore["step"], restore
