"""Checkpoints through the GPT recipe's command line, one process: crashes, corruption, mismatch, inspect."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import warm
from support import (
    REPO,
    TINY_MODEL,
    checkpoints_fingerprint,
    flat_tensors,
    run_recipe,
    wait_for,
    worker_env,
)

from elastic._worker.checkpoint import read_checkpoint
from elastic._worker.observe.events import read_events

pytestmark = pytest.mark.slow


def recipe_args(corpus: Path, ckpt: Path, steps: int, *extra: str) -> list[str]:
    return [
        "--data", str(corpus), "--ckpt-dir", str(ckpt), "--max-steps", str(steps), "--ckpt-every", "5",
        "--eval-every", "0", *TINY_MODEL, *extra,
    ]


def inspect(directory: Path) -> subprocess.CompletedProcess[str]:
    return warm.run([sys.executable, "-m", "elastic.checkpoint", "inspect", str(directory)], timeout=60, cwd=REPO,
                    env=worker_env())


def test_a_crash_during_a_save_resumes_from_the_previous_checkpoint(tmp_path: Path, tiny_corpus: Path) -> None:
    ckpt, events = tmp_path / "ckpt", tmp_path / "events.jsonl"
    args = recipe_args(tiny_corpus, ckpt, 25, "--events", str(events))
    crashed = run_recipe(*args, env=worker_env(ELASTIC_FAULT="before_commit@20"))
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    (torn,) = ckpt.glob(".tmp.step_00000020.*")
    written = {p.name for p in torn.iterdir()}
    assert {"manifest.json", "shard_00000.bin", "tensors.json", "trainer.pt"} <= written, "died after the files, before the commit"
    listing = inspect(ckpt)
    assert listing.returncode == 0, listing.stderr
    assert "step_00000015" in listing.stdout and "step_00000020" not in listing.stdout

    resumed = run_recipe(*args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    restores = [e for e in read_events(events) if e["event"] == "restore"]
    assert [(e["step"], e["checkpoint"]) for e in restores] == [(15, "step_00000015")]
    assert not list(ckpt.glob(".tmp*")), "the torn save was cleaned up"
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000015", "step_00000020", "step_00000025"]


def test_inspect_and_resume_skip_a_corrupt_checkpoint(tmp_path: Path, tiny_corpus: Path) -> None:
    ckpt = tmp_path / "ckpt"
    assert run_recipe(*recipe_args(tiny_corpus, ckpt, 15)).returncode == 0
    (shard,) = (ckpt / "step_00000015").glob("shard_*.bin")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only a chunk's crc32c can tell
    shard.write_bytes(bytes(data))

    listing = inspect(ckpt)
    assert listing.returncode == 0
    lines = {line.split()[0]: line for line in listing.stdout.splitlines()[1:-1]}
    assert "CORRUPT" in lines["step_00000015"] and lines["step_00000010"].endswith("ok")
    assert "latest -> step_00000015; 2 of 3 verify" in listing.stdout

    resumed = run_recipe(*recipe_args(tiny_corpus, ckpt, 20))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "checkpoint" in resumed.stderr and "step_00000015 is corrupt" in resumed.stderr
    assert "resumed from step_00000010" in resumed.stderr
    assert (ckpt / "step_00000015.corrupt").is_dir(), "moved aside for a post-mortem"


def test_all_corrupt_gives_one_line_and_a_non_zero_exit(tmp_path: Path, tiny_corpus: Path) -> None:
    ckpt = tmp_path / "ckpt"
    assert run_recipe(*recipe_args(tiny_corpus, ckpt, 10)).returncode == 0
    for trainer in ckpt.glob("step_*/trainer.pt"):
        data = bytearray(trainer.read_bytes())
        data[-40] ^= 0x10
        trainer.write_bytes(bytes(data))
    before = checkpoints_fingerprint(ckpt)
    result = run_recipe(*recipe_args(tiny_corpus, ckpt, 20))
    assert result.returncode == 1
    (error,) = [line for line in result.stderr.splitlines() if "error:" in line]
    assert error.startswith("gpt.py: error: no checkpoint in") and "move them away" in error
    assert checkpoints_fingerprint(ckpt) == before, "nothing saved was touched"
    assert inspect(ckpt).returncode == 1


def test_a_checkpoint_of_another_model_is_refused_in_one_line(tmp_path: Path, tiny_corpus: Path) -> None:
    ckpt = tmp_path / "ckpt"
    assert run_recipe(*recipe_args(tiny_corpus, ckpt, 5)).returncode == 0
    before = checkpoints_fingerprint(ckpt)
    wider = [*recipe_args(tiny_corpus, ckpt, 10)]
    wider[wider.index("--n-embd") + 1] = "96"
    result = run_recipe(*wider)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "gpt.py: error: checkpoint step_00000005 is for another model: "
        "model tok_emb.weight has shape [256, 64] there and [256, 96] here"  # format 2 names the part: model or optimizer
    )
    assert checkpoints_fingerprint(ckpt) == before


def test_sigterm_commits_the_current_step_and_exits_143(tmp_path: Path, tiny_corpus: Path) -> None:
    ckpt, events = tmp_path / "ckpt", tmp_path / "events.jsonl"
    args = recipe_args(tiny_corpus, ckpt, 100_000, "--events", str(events), "--ckpt-every", "0")
    with open(tmp_path / "stderr", "wb") as err:
        proc = warm.start([sys.executable, str(REPO / "recipes" / "gpt.py"), *args], stdout=subprocess.DEVNULL,
                          stderr=err, env=worker_env(), cwd=REPO)
    try:
        wait_for(lambda: events.exists() and any(e["event"] == "step" and e["step"] >= 20 for e in read_events(events)), 60, "step 20")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    stderr = (tmp_path / "stderr").read_text(errors="replace")
    assert proc.returncode == 143, stderr[-2000:]
    (save,) = [e for e in read_events(events) if e["event"] == "checkpoint"]
    last_step = max(e["step"] for e in read_events(events) if e["event"] == "step")
    assert save["reason"] == "preemption" and save["step"] == last_step >= 20
    assert f"stopped by SIGTERM after step {last_step}; checkpoint committed" in stderr.splitlines()[-1]
    manifest, tensors, trainer = read_checkpoint(ckpt / f"step_{last_step:08d}")  # every byte verifies
    assert manifest.step == trainer["step"] == last_step and manifest.reason == "preemption"
    assert "model/tok_emb.weight" in tensors
    assert len(dict(flat_tensors(trainer["rng"]))) >= 3
