"""Restore in real recipe runs: a restore slower than its deadline and a second job
on the same --ckpt-dir each end in one line, and nothing saved is touched."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import warm
from support import REPO, TINY_MODEL, run_recipe, standalone_command, worker_env

from elastic._shared.storage.claim import WriterIdentity
from elastic._shared.storage.directory import CheckpointStore
from elastic._worker.observe.events import read_events


def recipe_args(corpus: Path, ckpt: Path, steps: int, *extra: str) -> list[str]:
    return [
        "--data", str(corpus), "--max-steps", str(steps), "--eval-every", "0", "--sample-tokens", "0",
        "--ckpt-dir", str(ckpt), "--ckpt-every", "3", *TINY_MODEL, *extra,
    ]


def test_a_restore_slower_than_its_deadline_stops_with_one_line_and_exit_75(tmp_path: Path, tiny_corpus: Path) -> None:
    ckpt = tmp_path / "ckpt"
    first = run_recipe(*recipe_args(tiny_corpus, ckpt, 3), timeout=180)
    assert first.returncode == 0, first.stderr[-3000:]
    slow = run_recipe(
        *recipe_args(tiny_corpus, ckpt, 6, "--ckpt-restore-timeout", "2"), timeout=180,
        env=worker_env(ELASTIC_FAULT="during_read@3:do=slow:for=5"),
    )
    assert slow.returncode == 75, slow.stderr[-3000:]
    assert "Traceback" not in slow.stderr
    assert slow.stderr.strip().splitlines()[-1] == (
        f"gpt.py: error: restoring step_00000003 from {ckpt} did not finish within 2 s (--ckpt-restore-timeout): "
        "the storage is too slow or hung"
    )
    store = CheckpointStore(ckpt)
    assert [c.step for c in store.committed()] == [3]
    store.verify(store.committed()[0])
    # The same storage at its normal speed: the job resumes from that checkpoint.
    again = run_recipe(*recipe_args(tiny_corpus, ckpt, 6), timeout=180)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from step_00000003" in again.stderr


def test_a_second_job_on_the_same_directory_is_refused_and_its_files_left_alone(
    tmp_path: Path, tiny_corpus: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        # Another job, alive on this host, claimed the directory and is writing a save.
        # An old heartbeat: the process itself, alive, is what counts.
        claim = WriterIdentity.of_process("other-job", other.pid, writer="0123456789ab", heartbeat=0.0)
        (ckpt / "writer.json").write_text(claim.to_json())
        in_progress = ckpt / ".tmp.step_00000040.0123abcd"
        in_progress.mkdir()
        (in_progress / "shard_00000.bin").write_bytes(b"\0" * 64)

        result = run_recipe(*recipe_args(tiny_corpus, ckpt, 3), timeout=180)
        assert result.returncode == 75, result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith(f"gpt.py: error: {ckpt} is written by another job (run other-job on ")
        assert "give each job its own --ckpt-dir" in last
        assert (in_progress / "shard_00000.bin").exists(), "the other job's save in progress is untouched"
        assert CheckpointStore(ckpt).writer() == claim
    finally:
        other.kill()
        other.wait()
    # That job gone, the directory is taken over: its stale temporary goes, training goes on.
    result = run_recipe(*recipe_args(tiny_corpus, ckpt, 3), timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not in_progress.exists()
    assert CheckpointStore(ckpt).writer().run_id != "other-job"


def test_a_peer_dying_mid_restore_is_a_failure_the_launcher_restarts(tmp_path: Path, tiny_corpus: Path) -> None:
    ckpt = tmp_path / "ckpt"
    first = warm.run(
        standalone_command(2, recipe_args(tiny_corpus, ckpt, 3)), timeout=300,
        cwd=REPO, env=worker_env(),
    )
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    # Rank 1 is SIGKILLed after reading its first chunk of step 3 (first attempt only):
    # rank 0's restore fails on a dead peer. Not exit 75 (storage): the group restarts and resumes.
    done = warm.run(
        standalone_command(2, recipe_args(tiny_corpus, ckpt, 6, "--events", str(tmp_path / "events.jsonl")),
                           max_restarts=1, launcher="elastic._agent.launcher"),
        timeout=300, cwd=REPO,
        env=worker_env(ELASTIC_FAULT="during_read@3:rank=1"),
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "exit status 75" not in output
    restores = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "restore"]
    assert [(e["restart"], e["step"]) for e in restores] == [(1, 3)]
    assert [c.step for c in CheckpointStore(ckpt).committed()][0] == 6
