"""recipes/tutorial.py, the classic DDP tutorial on the front door, as real jobs:
killed under two torchrun agents and compared tensor by tensor with a clean run,
resized 2 -> 3 -> 1 ranks with its DataLoader workers and audited exactly-once,
and deaf to SIGTERMs that reach only its loader workers."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import warm
from references import References
from support import (
    REPO,
    assert_same_tensors,
    checkpoint_tensors,
    children_of,
    free_port,
    kill_worker_after,
    logs,
    standalone_command,
    start_agents,
    steps_seen,
    torchrun_command,
    wait_all,
    wait_for,
    worker_env,
)

from elastic._worker.observe.events import read_events
from elastic.chaos.samples import audit

pytestmark = pytest.mark.slow

TUTORIAL = REPO / "recipes" / "tutorial.py"
POINTS, BATCH, EPOCHS = 320, 16, 4
"""A small data set (the last eighth held out: 280 training points) at 16 a rank: 9 steps an epoch at 2 ranks."""
STEPS = -(-EPOCHS * (POINTS - POINTS // 8) // (2 * BATCH))


def small_data(directory: Path, points: int = POINTS) -> Path:
    path = directory / f"points{points}.npz"
    generator = np.random.default_rng(0)
    np.savez(path, x=generator.normal(size=(points, 32)).astype(np.float32), y=generator.integers(0, 8, size=points))
    return path


def job_args(out: Path, data: Path, *, epochs: int = EPOCHS, workers: int = 2, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        "--data", str(data), "--epochs", str(epochs), "--batch-size", str(BATCH), "--ckpt-dir", str(out / "ckpt"),
        "--ckpt-every", "7", "--events", str(out / "events.jsonl"), "--workers", str(workers), "--device", "cpu", *extra,
    ]


def start_two_agents(out: Path, data: Path) -> list[subprocess.Popen]:
    command = torchrun_command(
        nnodes="2:2", port=free_port(), run_id=out.name, max_restarts=2, script=TUTORIAL, script_args=job_args(out, data),
    )
    return start_agents(2, command, out)


def test_a_worker_killed_at_any_step_changes_nothing(tmp_path: Path, references: References) -> None:
    """Under two torchrun agents, against the uninterrupted run of tests/references.py."""
    killed = tmp_path / "killed"
    killed.mkdir()
    data = small_data(tmp_path)

    kill_after = random.Random().randint(3, STEPS - 8)
    events = killed / "events.jsonl"
    agents = start_two_agents(killed, data)
    kill_worker_after(agents, events, kill_after)
    assert wait_all(agents, timeout=240) == [0, 0], logs(killed)
    # A second group started (before the first checkpoint, at step 7, it starts over: no restore event;
    # rank 0's agent may count the new round as a membership change, not a restart).
    starts = [e for e in read_events(events) if e["event"] == "start"]
    assert len(starts) >= 2, f"no new worker group after the kill at step {kill_after}"
    clean = references.final_checkpoint(
        ["--data", str(data), "--epochs", str(EPOCHS), "--batch-size", str(BATCH), "--workers", "2", "--device", "cpu"],
        STEPS, script=TUTORIAL,
    )
    assert_same_tensors(
        checkpoint_tensors(clean.parent, STEPS), checkpoint_tensors(killed / "ckpt", STEPS),
        f"after the kill at step {kill_after}",
    )


def test_loader_path_uses_every_sample_once_across_world_sizes_2_3_1(tmp_path: Path) -> None:
    """Each stage stops at an epoch's end (--epochs), whatever the world size: 175 training points at 8 a rank."""
    data = small_data(tmp_path, points=200)
    batch, prefix, train = 8, tmp_path / "samples", 200 - 200 // 8
    # 2 ranks to the end of epoch 0 (11 steps), 3 ranks through epoch 1 (7 more), one rank through epoch 2.
    steps = [-(-train // (2 * batch))]
    steps.append(steps[0] + -(-(2 * train - steps[0] * 2 * batch) // (3 * batch)))
    steps.append(steps[1] + -(-(3 * train - steps[0] * 2 * batch - (steps[1] - steps[0]) * 3 * batch) // batch))
    total = steps[-1]
    for world, epochs in ((2, 1), (3, 2), (1, 3)):
        args = ["--data", str(data), "--batch-size", str(batch), "--epochs", str(epochs), "--ckpt-every", "0",
                "--ckpt-dir", str(tmp_path / "ckpt"), "--events", str(tmp_path / "events.jsonl"), "--workers", "2"]
        result = warm.run(
            standalone_command(world, args, script=TUTORIAL, record_samples=True),
            timeout=180, cwd=REPO, env=worker_env(ELASTIC_SAMPLE_LOG=str(prefix)),
        )
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]

    events = list(read_events(tmp_path / "events.jsonl"))
    assert [(e["step"], e["world_size"]) for e in events if e["event"] == "restore"] == [(steps[0], 3), (steps[1], 1)]
    samples = audit(prefix)
    assert samples.ok, samples.problems
    assert (samples.first_step, samples.last_step, samples.epochs_complete) == (1, total, 3)


def test_sigterm_to_its_loader_workers_only_does_not_stop_it(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    with open(tmp_path / "output", "wb") as out:
        trainer = warm.start([sys.executable, str(TUTORIAL), *job_args(tmp_path, small_data(tmp_path), epochs=100_000)],
                             stdout=out, stderr=subprocess.STDOUT, env=worker_env(), cwd=REPO)
    try:
        wait_for(lambda: steps_seen(events) >= 3, 120, "three steps")
        workers = children_of(trainer.pid)
        assert len(workers) == 2, workers
        for _ in range(3):
            for pid in workers:
                os.kill(pid, signal.SIGTERM)
        reached = steps_seen(events)
        wait_for(lambda: steps_seen(events) >= reached + 20, 120, "twenty more steps")
        assert trainer.poll() is None, "the trainer stopped on its workers' signal"
        os.kill(trainer.pid, signal.SIGTERM)  # its own signal still means: commit and leave
        trainer.wait(timeout=120)
    finally:
        trainer.kill()
    output = (tmp_path / "output").read_text(errors="replace")
    assert trainer.returncode == 143, output[-3000:]
    # Its own signal committed the step it stopped at: a preemption checkpoint, or the periodic one of that
    # step when the stop fell on a multiple of --ckpt-every 7 (then there is nothing more to save).
    stopped_at = int(re.search(r"stopped by SIGTERM after step (\d+)", output).group(1))
    saved = [e for e in read_events(events) if e["event"] == "checkpoint" and e["step"] == stopped_at]
    assert saved and saved[-1]["reason"] in ("preemption", "periodic"), output[-3000:]
