"""Real torchrun jobs that lose workers and must end as if nothing happened."""

from __future__ import annotations

import os
import random
import signal
import subprocess
from pathlib import Path

import pytest
import torch
import warm
from references import REFERENCE_STEPS, References, gpt_args
from support import (
    REPO,
    TINY_MODEL,
    children_of,
    free_port,
    kill_worker_after,
    logs,
    make_text,
    seeded_rng,
    standalone_command,
    start_agents,
    steps_seen,
    torchrun_command,
    wait_all,
    wait_for,
    worker_env,
    worker_rank,
)
from text_data import split_corpus

from elastic._worker.checkpoint import read_checkpoint
from elastic._worker.observe.events import read_events
from elastic.chaos.samples import audit

pytestmark = pytest.mark.slow


def run_two_agents(tmp: Path, corpus: Path, port: int, steps: int, *, kill_after: int | None = None) -> Path:
    """A 2-agent job under plain torchrun (exactly 2 nodes, so the world size never changes); optionally
    SIGKILL a worker. The recipe's arguments are those of the shared reference runs (tests/references.py)."""
    tmp.mkdir()
    ckpt, events = tmp / "ckpt", tmp / "events.jsonl"
    command = torchrun_command(
        nnodes="2:2", port=port, run_id=tmp.name, max_restarts=2,
        script_args=[*gpt_args(corpus, steps), "--ckpt-dir", str(ckpt), "--ckpt-every", "10", "--events", str(events)],
    )
    agents = start_agents(2, command, tmp)
    if kill_after is not None:
        kill_worker_after(agents, events, kill_after, rank=1)
        print(f"SIGKILLed rank 1 with the event log at step {steps_seen(events)}", flush=True)
    codes = wait_all(agents, timeout=240)
    assert codes == [0, 0], logs(tmp)
    return tmp


def test_sigkilled_worker_resumes_bit_identical(tmp_path: Path, shared_corpus: Path, references: References) -> None:
    """Plain torchrun, which restarts every worker and has no snapshots: the job resumes from the
    disk and ends bit-identical to an uninterrupted run (tests/references.py)."""
    steps = REFERENCE_STEPS
    # Some checkpoints (every 10) are behind it; the seed is printed, TORCHREVIVE_TEST_SEED replays it.
    kill_after = seeded_rng("kill step").randint(22, 38)
    print(f"kill rank 1 once the event log reaches step {kill_after}", flush=True)
    faulty = run_two_agents(tmp_path / "faulty", shared_corpus, free_port(), steps, kill_after=kill_after)
    clean = references.final_checkpoint(gpt_args(shared_corpus, steps), steps)

    events = list(read_events(faulty / "events.jsonl"))
    restores = [e for e in events if e["event"] == "restore"]
    assert restores, f"the kill after step {kill_after} did not cause a restart:\n{logs(faulty)}"
    assert all(e["step"] >= 20 and e["world_size"] == 2 for e in restores)
    # (No check of `restart`: rank 0 may sit on the agent whose workers were stopped
    # for the new round rather than failed, and torchrun counts only failures.)

    _, want_tensors, want_trainer = read_checkpoint(clean)
    _, got_tensors, got_trainer = read_checkpoint(faulty / "ckpt" / f"step_{steps:08d}")
    # The model's weights and buffers, and the optimizer's state (moments, step counts) and settings.
    for prefix in ("model/", "optim/"):
        want = {key: t for key, t in want_tensors.items() if key.startswith(prefix)}
        got = {key: t for key, t in got_tensors.items() if key.startswith(prefix)}
        assert want and want.keys() == got.keys()
        different = [key for key in want if not torch.equal(want[key], got[key])]
        assert not different, f"{prefix}: {len(different)} tensors differ after the kill at step {kill_after}, e.g. {different[:3]}"
    assert got_trainer["optimizer"] == want_trainer["optimizer"]


def test_every_sample_once_across_world_sizes_2_3_1(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_text(random.Random(5), 4_000))
    train_set, _ = split_corpus(corpus.read_bytes(), block_size=32)
    n = len(train_set)
    batch = 4
    steps_w2, steps_w3 = 3, 3
    remaining = n - steps_w2 * batch * 2 - steps_w3 * batch * 3
    assert remaining > 0
    total_steps = steps_w2 + steps_w3 + -(-remaining // batch)  # the W=1 run reaches the end of epoch 0
    log_prefix = tmp_path / "samples"
    common = [
        "--data", str(corpus), "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "0", "--eval-every", "0",
        "--events", str(tmp_path / "events.jsonl"), "--n-layer", "1", "--n-head", "2", "--n-embd", "32",
        "--block-size", "32", "--batch-size", str(batch),
    ]
    for world, until in ((2, steps_w2), (3, steps_w2 + steps_w3), (1, total_steps)):
        result = warm.run(
            standalone_command(world, [*common, "--max-steps", str(until)], record_samples=True),
            timeout=180, cwd=REPO, env=worker_env(ELASTIC_SAMPLE_LOG=str(log_prefix)),
        )
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]

    events = list(read_events(tmp_path / "events.jsonl"))
    assert [(e["step"], e["world_size"]) for e in events if e["event"] == "restore"] == [
        (steps_w2, 3), (steps_w2 + steps_w3, 1),
    ]
    samples = audit(log_prefix)
    assert samples.ok, samples.problems
    assert (samples.first_step, samples.last_step) == (1, total_steps)
    assert samples.epochs_complete == 1, "the W=1 run reaches the end of epoch 0"


def test_sigterm_to_one_worker_checkpoints_the_job_and_it_resumes(tmp_path: Path, tiny_corpus: Path) -> None:
    ckpt, events = tmp_path / "ckpt", tmp_path / "events.jsonl"
    steps = 400
    args = [
        "--data", str(tiny_corpus), "--max-steps", str(steps), "--ckpt-dir", str(ckpt), "--ckpt-every", "0",
        "--eval-every", "0", "--events", str(events), *TINY_MODEL,
    ]
    log = open(tmp_path / "job.log", "wb")
    job = warm.popen(standalone_command(2, args, max_restarts=1), stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=worker_env())
    try:
        wait_for(lambda: steps_seen(events) >= 15, 120, "step 15")
        victim = next(pid for pid in children_of(job.pid) if worker_rank(pid) == 1)
        os.kill(victim, signal.SIGTERM)
        assert job.wait(timeout=240) == 0, logs(tmp_path)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()

    history = list(read_events(events))
    (preempted,) = [e for e in history if e["event"] == "checkpoint" and e["reason"] == "preemption"]
    step_at_signal = preempted["step"]
    assert step_at_signal >= 15
    (restore,) = [e for e in history if e["event"] == "restore"]
    assert restore["step"] == step_at_signal, "the job went on from the step it was stopped at: no work lost"
    assert [e["step"] for e in history if e["event"] == "end"] == [steps]
