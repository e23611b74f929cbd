"""Storage faults in real jobs: a full disk stops the job with one line and exit 75
and is not restarted by our launcher; slow storage trips neither the watchdog nor
the collective timeout."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
import warm
from store_helpers import describe, temporaries
from support import REPO, TINY_MODEL, run_recipe, standalone_command, worker_env

from elastic._shared.storage.directory import CheckpointStore
from elastic._shared.storage.durable import SaveFailed
from elastic._worker.observe.events import read_events
from elastic.chaos.verdict import verified_final_checkpoint


def recipe_args(corpus: Path, tmp_path: Path, steps: int, *extra: str) -> list[str]:
    return [
        "--data", str(corpus), "--max-steps", str(steps), "--eval-every", "0", "--ckpt-dir", str(tmp_path / "ckpt"),
        "--ckpt-every", "5", "--events", str(tmp_path / "events.jsonl"), *TINY_MODEL, *extra,
    ]


def kinds(events: Path, kind: str) -> list[dict]:
    return [e for e in read_events(events) if e["event"] == kind]


def test_a_full_disk_stops_a_single_process_with_one_line(tmp_path: Path, tiny_corpus: Path) -> None:
    result = run_recipe(
        *recipe_args(tiny_corpus, tmp_path, 60), timeout=180,
        env=worker_env(ELASTIC_FAULT="during_write@10+:do=enospc"),
    )
    assert result.returncode == 75, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("gpt.py: error: 3 checkpoints in a row failed (--ckpt-max-failures), the last: cannot write step_00000020")
    assert "step_00000005, is intact" in last
    assert [e["step"] for e in kinds(tmp_path / "events.jsonl", "checkpoint_failed")] == [10, 15, 20]
    assert [c.step for c in CheckpointStore(tmp_path / "ckpt").committed()] == [5]


def test_our_launcher_does_not_restart_a_job_whose_storage_fails(tmp_path: Path, tiny_corpus: Path) -> None:
    done = warm.run(
        standalone_command(2, recipe_args(tiny_corpus, tmp_path, 60, "--ckpt-max-failures", "2"),
                           max_restarts=3, launcher="elastic._agent.launcher"),
        timeout=300, cwd=REPO,
        # The fault is injected in the workers only: their launcher's snapshot keeper would find
        # the disk fine and commit the newest snapshot (a really full disk refuses it too).
        env=worker_env(ELASTIC_FAULT="during_write@10+:do=enospc:restart=any", TORCHREVIVE_SNAPSHOTS="0"),
    )
    output = done.stdout + done.stderr
    assert done.returncode == 75, output[-4000:]
    assert "will restart worker group" not in output, "a restart would meet the same storage"
    assert "torchrevive-run: job stopped: worker rank" in output and "exit status 75" in output
    assert "2 checkpoints in a row failed" in output
    starts = kinds(tmp_path / "events.jsonl", "start")
    assert len(starts) == 1 and {e["restart"] for e in starts} == {0}
    assert [c.step for c in CheckpointStore(tmp_path / "ckpt").committed()] == [5]


def test_saves_slower_than_every_timeout_trip_none(tmp_path: Path, tiny_corpus: Path) -> None:
    # Step 10's save and the final one each stall 9 s: longer than the watchdog (2 s) and
    # the collective timeout (4 s). Saves due meanwhile are skipped; the job finishes.
    done = warm.run(
        standalone_command(2, recipe_args(tiny_corpus, tmp_path, 30, "--hang-timeout", "2", "--collective-timeout", "4"),
                           max_restarts=0),
        timeout=300, cwd=REPO,
        env=worker_env(ELASTIC_FAULT="during_write@10:do=slow:for=9,during_write@30:do=slow:for=9"),
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "watchdog: no training step" not in output
    events = tmp_path / "events.jsonl"
    assert kinds(events, "checkpoint_skipped"), "saves due while step 10's was writing are skipped"
    assert kinds(events, "checkpoint_failed") == []
    assert [e["step"] for e in kinds(events, "end")] == [30]
    name, error = verified_final_checkpoint(tmp_path / "ckpt", 30)
    assert name, error


@pytest.fixture
def small_volume(tmp_path: Path):
    """A 1 MB tmpfs (root only): a real full disk."""
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("mount and umount are not installed (Debian: mount)")
    mount = tmp_path / "volume"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", f"torchrevive-{uuid.uuid4().hex[:6]}", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_real_full_disk_names_enospc_and_leaves_nothing_behind(small_volume: Path) -> None:
    store = CheckpointStore(small_volume / "ckpt")
    store.prepare()
    store.commit(1, {"model.pt": {"w": torch.ones(1000)}}, describe=describe(1))
    with pytest.raises(SaveFailed) as caught:  # 2 MB into a 1 MB volume
        store.commit(2, {"model.pt": {"w": torch.ones(512 * 1024)}}, describe=describe(2))
    assert str(caught.value).startswith(f"cannot write step_00000002 to {small_volume / 'ckpt'}: No space left on device (ENOSPC)")
    assert temporaries(small_volume / "ckpt") == []
    assert [c.step for c in store.committed()] == [1]
    store.verify(store.committed()[0])


def test_a_claim_that_cannot_be_written_stops_every_rank_with_one_line(small_volume: Path, tiny_corpus: Path) -> None:
    ckpt = small_volume / "ckpt"
    ckpt.mkdir()
    with open(small_volume / "filler", "wb") as filler:  # the volume full: writing writer.json fails (ENOSPC)
        try:
            while True:
                filler.write(b"\0" * 65536)
                filler.flush()
        except OSError:
            pass
    args = ["--data", str(tiny_corpus), "--max-steps", "4", "--eval-every", "0", "--ckpt-dir", str(ckpt), *TINY_MODEL]
    done = warm.run(standalone_command(2, args), timeout=300, cwd=REPO,
                          env=worker_env(TORCHREVIVE_SNAPSHOTS="0"))
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-4000:]
    assert "OSError" not in output, output[-4000:]  # (the only traceback is stock torchrun's own ChildFailedError)
    lines = [line for line in output.splitlines() if line.startswith("gpt.py: error:")]
    # Every rank leaves with the same one line and exit 75 (torchrun may stop the second before it reports).
    assert lines == [f"gpt.py: error: cannot claim checkpoint directory {ckpt}: No space left on device (ENOSPC)"] * 2
    assert "(exitcode: 75)" in output, output[-4000:]
