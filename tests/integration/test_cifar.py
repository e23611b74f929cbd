"""The CIFAR-10 recipe as real jobs: two torchrun agents learning a tiny CIFAR-format
set, a SIGKILLed worker that must change nothing, and the one line a user without
the data set gets."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import warm
from cifar_model import CPUSyncBatchNorm
from rank_processes import run_ranks
from support import (
    CIFAR_RECIPE,
    REPO,
    assert_same_tensors,
    checkpoint_tensors,
    free_port,
    kill_worker_after,
    logs,
    start_agents,
    steps_seen,
    torchrun_command,
    wait_all,
    wait_for,
    worker_env,
    write_cifar10,
)
from torch import nn

from elastic._worker.observe.events import read_events

TRAIN_IMAGES, TEST_IMAGES, BATCH = 320, 80, 16
STEPS_PER_EPOCH = TRAIN_IMAGES // (BATCH * 2)  # at world size 2
EPOCHS = 12
STEPS = EPOCHS * STEPS_PER_EPOCH
TINY_CNN = ["--model", "cnn", "--cnn-width", "8", "--batch-size", str(BATCH), "--lr", "0.2", "--eval-batch-size", "40"]




def recipe_args(data: Path, out: Path, *, workers: int, steps: int = STEPS) -> list[str]:
    return [
        "--data", str(data), "--max-steps", str(steps), "--ckpt-dir", str(out / "ckpt"), "--ckpt-every", "7",
        "--events", str(out / "events.jsonl"), "--workers", str(workers), *TINY_CNN,
    ]


def start_two_agents(data: Path, out: Path, *, workers: int) -> list[subprocess.Popen]:
    """A job of exactly two agents of one worker each (the world size never changes)."""
    command = torchrun_command(
        nnodes="2:2", port=free_port(), run_id=out.name, max_restarts=2, script=CIFAR_RECIPE,
        script_args=recipe_args(data, out, workers=workers),
    )
    return start_agents(2, command, out)


def final_state(out: Path, step: int = STEPS) -> dict[str, dict[str, torch.Tensor]]:
    return checkpoint_tensors(out / "ckpt", step)


@pytest.fixture(scope="module")
def tiny_cifar(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_cifar10(tmp_path_factory.mktemp("cifar"), train=TRAIN_IMAGES, test=TEST_IMAGES)


@pytest.fixture(scope="module")
def two_agent_run(tiny_cifar: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted two-agent job, one DataLoader worker per rank: the tests below
    read its events and compare against its final checkpoint."""
    out = tmp_path_factory.mktemp("clean")
    codes = wait_all(start_two_agents(tiny_cifar, out, workers=1), timeout=240)
    assert codes == [0, 0], logs(out)
    return out


@pytest.mark.slow
def test_two_agents_learn_above_chance_and_end_with_identical_weights_and_batchnorm_buffers(
    two_agent_run: Path,
) -> None:
    events = list(read_events(two_agent_run / "events.jsonl"))
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(1, STEPS + 1))
    assert {e["world_size"] for e in events} == {2}, "both agents joined one round"

    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == list(range(STEPS_PER_EPOCH, STEPS + 1, STEPS_PER_EPOCH)), "one per epoch"
    accuracies = [e["accuracy"] for e in evals]
    assert accuracies[-1] >= 0.6 and accuracies[-1] > accuracies[0], f"chance is 0.1; accuracy by epoch: {accuracies}"

    (end,) = [e for e in events if e["event"] == "end"]
    digests = end["param_digests"]  # over state_dict(): parameters and batch norm buffers
    assert len(digests) == 2 and digests[0] == digests[1], "ranks ended with different weights or buffers"
    # Each rank normalised its own half batch and no buffer is broadcast: equal buffers
    # mean the statistics were the whole job's. They did move from their initial values.
    model = final_state(two_agent_run)["model"]
    tracked = {k: v for k, v in model.items() if k.endswith("num_batches_tracked")}
    assert len(tracked) == 3 and all(v.item() == STEPS for v in tracked.values())
    assert all(not torch.all(v == 0) for k, v in model.items() if k.endswith("running_mean"))


@pytest.mark.slow
def test_checkpoint_of_two_synced_ranks_resumes_in_a_single_process(
    two_agent_run: Path, tiny_cifar: Path, tmp_path: Path,
) -> None:
    shutil.copytree(two_agent_run / "ckpt", tmp_path / "ckpt")
    more, port = STEPS + 4, free_port()
    result = warm.run(
        [
            sys.executable, str(CIFAR_RECIPE), *recipe_args(tiny_cifar, tmp_path, workers=0, steps=more),
            "--metrics-port", str(port),
        ],
        timeout=120, env=worker_env(), cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"metrics: serving http://127.0.0.1:{port}/metrics" in result.stderr
    events = list(read_events(tmp_path / "events.jsonl"))
    (restore,) = [e for e in events if e["event"] == "restore"]
    assert (restore["step"], restore["saved_world_size"], restore["world_size"]) == (STEPS, 2, 1)
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(STEPS + 1, more + 1))


@pytest.mark.slow
def test_sigkilled_worker_resumes_bit_identical_with_loader_workers(
    two_agent_run: Path, tiny_cifar: Path, tmp_path: Path,
) -> None:
    # Checkpoints every 7 steps of 10-step epochs: restores land mid-epoch.
    kill_after = random.Random().randint(22, 45)
    events = tmp_path / "events.jsonl"
    agents = start_two_agents(tiny_cifar, tmp_path, workers=2)  # two loader workers: another split of the work
    kill_worker_after(agents, events, kill_after)
    assert wait_all(agents, timeout=240) == [0, 0], logs(tmp_path)

    restores = [e for e in read_events(events) if e["event"] == "restore"]
    assert restores, f"the kill after step {kill_after} did not cause a restart:\n{logs(tmp_path)}"
    # The save of the checkpoint just before the kill may still be in flight: one earlier.
    assert all(e["step"] >= 14 and e["world_size"] == 2 for e in restores)

    want, got = final_state(two_agent_run), final_state(tmp_path)
    assert any(k.endswith("running_var") for k in want["model"]), "batch norm buffers are compared too"
    assert want["optimizer"] and want["trainer"], "optimizer state and RNG states are compared too"
    assert_same_tensors(want, got, f"after the kill at step {kill_after}")


def test_missing_data_set_is_one_line_naming_the_file_and_where_to_get_it(tmp_path: Path) -> None:
    result = warm.run([sys.executable, str(CIFAR_RECIPE), "--data", str(tmp_path)], timeout=60, env=worker_env(), cwd=REPO)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "no cifar-10-batches-py/ folder" in line and "cifar-10-python.tar.gz" in line
    assert "https://www.cs.toronto.edu/~kriz/cifar.html" in line


def test_sigterm_to_the_process_group_commits_a_preemption_checkpoint_with_loader_workers(
    tiny_cifar: Path, tmp_path: Path,
) -> None:
    """torchrun stops a worker with SIGTERM to its process group, loader workers included:
    the trainer must still finish its step and commit, not fail on a dead loader."""
    events = tmp_path / "events.jsonl"
    with open(tmp_path / "output", "wb") as out:  # a warm process leads a session (and process group) of its own
        process = warm.start([sys.executable, str(CIFAR_RECIPE), *recipe_args(tiny_cifar, tmp_path, workers=2, steps=400)],
                             stdout=out, stderr=subprocess.STDOUT, env=worker_env(), cwd=REPO)
    try:
        wait_for(lambda: steps_seen(events) >= 3, 120, "three steps")
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    finally:
        process.kill()
    output = (tmp_path / "output").read_text(errors="replace")
    assert process.returncode == 143, output[-3000:]
    saved = [e for e in read_events(events) if e["event"] == "checkpoint" and e["reason"] == "preemption"]
    assert saved, output[-3000:]


def _sync_batch_norm_rank(rank: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool (it can hang)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        x, grad_y, state = torch.load(os.path.join(out_dir, "inputs.pt"))
        layer = CPUSyncBatchNorm(3)
        layer.load_state_dict(state)
        half = x[rank * 4 : rank * 4 + 4].clone().requires_grad_()
        (layer(half) * grad_y[rank * 4 : rank * 4 + 4]).sum().backward()
        layer(half)  # a second batch: the running statistics compound
        torch.save(
            {"grad_x": half.grad, "weight": layer.weight.grad, "bias": layer.bias.grad,
             "buffers": {k: v for k, v in layer.state_dict().items() if k.startswith(("running", "num"))},
             "y": layer.eval()(half).detach()},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def test_two_ranks_normalise_with_the_statistics_of_their_joint_batch(tmp_path: Path) -> None:
    """Each rank holds half a batch; the result must be batch norm over the whole of it."""
    torch.manual_seed(0)
    x = torch.randn(8, 3, 6, 6) * 3 + torch.tensor([1.0, -2.0, 5.0]).view(1, 3, 1, 1)
    x[4:] += 2.0  # the halves differ: local statistics would give other numbers
    grad_y = torch.randn(8, 3, 6, 6)
    whole = nn.BatchNorm2d(3)
    with torch.no_grad():
        whole.weight.uniform_(0.5, 1.5)
        whole.bias.uniform_(-0.5, 0.5)
    torch.save((x, grad_y, whole.state_dict()), tmp_path / "inputs.pt")
    run_ranks(_sync_batch_norm_rank, 2, str(tmp_path / "store"), str(tmp_path), timeout=60)

    xs = x.clone().requires_grad_()
    (whole(xs) * grad_y).sum().backward()  # the loss is the sum of both ranks' losses
    whole(xs)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    torch.testing.assert_close(torch.cat([r["grad_x"] for r in results]), xs.grad)
    # Weight and bias gradients stay per rank (DDP averages them); their sum is the whole batch's.
    torch.testing.assert_close(results[0]["weight"] + results[1]["weight"], whole.weight.grad)
    torch.testing.assert_close(results[0]["bias"] + results[1]["bias"], whole.bias.grad)
    for key, value in results[0]["buffers"].items():
        assert torch.equal(value, results[1]["buffers"][key]), f"{key} differs between the ranks"
        torch.testing.assert_close(value, whole.state_dict()[key])
    torch.testing.assert_close(torch.cat([r["y"] for r in results]), whole.eval()(x))
