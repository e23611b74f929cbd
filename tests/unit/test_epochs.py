"""Epochs as a unit (elastic._worker.run.epochs) and random streams kept out of work between steps, in one
process: `run.batches(max_epochs=)`, the epoch form `for epoch in run.epochs(N)` with its end-of-epoch point,
`--ckpt-every` in epochs, and a run that dies at an epoch's end and resumes past it (its evaluation, which
drew from every random stream, skipped) ending bit-identical to one never interrupted.

The same with real processes and a real kill: tests/integration/test_documented_commands.py."""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import elastic
from elastic._shared.common.errors import UsageError
from elastic._worker.checkpoint import CheckpointStore
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.observe.events import read_events
from elastic._worker.run.epochs import StepLimit, steps_to_epoch

SAMPLES, BATCH = 40, 6  # 40 samples at 6 a step: global batches straddle the epochs' ends


class DiedAtEpochEnd(Exception):
    """What a kill during an epoch's evaluation does to this process's run: it ends without its final save."""


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(SAMPLES, 3, generator=generator), torch.randn(SAMPLES, 1, generator=generator))


def evaluate(model: torch.nn.Module, test_set: TensorDataset) -> float:
    """An evaluation as people write it: dropout left on (train mode), a shuffled test loader, and a draw from
    python's and numpy's generators: every stream the checkpoint carries moves."""
    total = 0.0
    for x, y in DataLoader(test_set, batch_size=8, shuffle=True):
        total += torch.nn.functional.mse_loss(model(x), y).item()
    return total + random.random() + float(np.random.rand())


def train(tmp_path: Path, *, epochs: int = 3, evaluate_every_epoch: bool = True, die_after_epoch: int | None = None,
          **settings) -> tuple[dict[str, torch.Tensor], list[int], int]:
    """The epoch form with an evaluation at each epoch's end; returns the weights, the epochs seen, the last step."""
    dataset, seen = data(), []
    with elastic.Run(device="cpu", seed=3, ckpt_dir=str(tmp_path / "ckpt"), ckpt_every="1e",
                     events=str(tmp_path / "events.jsonl"), snapshot_every=0, **settings) as run:
        model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        run.start(model=model, optimizer=optimizer, data=dataset, batch_size=BATCH)
        loader = DataLoader(dataset, batch_sampler=run.batch_sampler())
        for epoch in run.epochs(epochs):
            seen.append(epoch)
            for x, y in run.batches(loader):
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                run.log(loss)
            if die_after_epoch == epoch:
                wait_for_committed(tmp_path / "ckpt", run.step)
                raise DiedAtEpochEnd  # killed during the evaluation: the checkpoint of this step is committed
            if evaluate_every_epoch:
                evaluate(model, data())
        return {k: v.clone() for k, v in model.state_dict().items()}, seen, run.step


def wait_for_committed(directory: Path, step: int) -> None:
    deadline = time.monotonic() + 30
    while not any(c.step == step for c in CheckpointStore(directory).committed()):
        assert time.monotonic() < deadline, f"step {step} was never committed"
        time.sleep(0.02)


def test_a_run_killed_at_an_epochs_end_resumes_past_its_evaluation_and_ends_bit_identical(tmp_path: Path) -> None:
    through, seen, last = train(tmp_path / "through")
    assert seen == [0, 1, 2] and last == steps_to_epoch(ElasticSampler(SAMPLES, batch_size=BATCH), 1, 3)
    with pytest.raises(DiedAtEpochEnd):
        train(tmp_path / "killed", die_after_epoch=1)
    resumed, seen, _ = train(tmp_path / "killed")  # restores epoch 1's last step: its evaluation never runs
    assert seen == [2]
    restores = [e for e in read_events(tmp_path / "killed" / "events.jsonl") if e["event"] == "restore"]
    assert [e["step"] for e in restores] == [steps_to_epoch(ElasticSampler(SAMPLES, batch_size=BATCH), 1, 2)]
    for name, tensor in through.items():
        assert torch.equal(tensor, resumed[name]), f"{name} differs: the evaluation moved the training stream"
    # Without evaluations at all the training is the same too: the epoch's end draws nothing from it.
    plain, _, _ = train(tmp_path / "plain", evaluate_every_epoch=False)
    assert all(torch.equal(plain[name], tensor) for name, tensor in through.items())


def test_a_pause_forks_every_random_stream_and_puts_it_back(tmp_path: Path) -> None:
    with elastic.Run(device="cpu", seed=1) as run:
        model = torch.nn.Linear(2, 1)
        run.start(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=8, batch_size=2)
        before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
        with run.pause():
            inside = (random.random(), float(np.random.rand()), torch.rand(1).item())
            list(DataLoader(range(10), shuffle=True))
        after = (random.getstate(), np.random.get_state()[1], torch.get_rng_state())
        assert before[0] == after[0] and np.array_equal(before[1], after[1]) and torch.equal(before[2], after[2])
        with run.pause():
            assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == inside  # the same fork
        with pytest.raises(ValueError), run.pause():
            torch.rand(5)
            raise ValueError("an evaluation that failed")
        assert torch.equal(torch.get_rng_state(), before[2]), "put back after an error too"


def test_max_epochs_ends_where_the_samplers_position_reaches_the_epoch_and_ckpt_every_counts_epochs(tmp_path: Path) -> None:
    dataset = data()
    with elastic.Run(device="cpu", ckpt_dir=str(tmp_path / "ckpt"), ckpt_every="1e", events=str(tmp_path / "ev.jsonl"),
                     snapshot_every=0) as run:
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        run.start(model=model, optimizer=optimizer, data=dataset, batch_size=BATCH)
        steps = 0
        for x, y in run.batches(DataLoader(dataset, batch_sampler=run.batch_sampler()), max_epochs=2):
            steps += 1
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        assert run.epoch == 2 and steps == run.step == 14  # ceil(80 / 6): the last batch reaches into epoch 2
    saved = [(e["step"], e.get("reason")) for e in read_events(tmp_path / "ev.jsonl") if e["event"] == "checkpoint"]
    assert saved == [(7, "periodic"), (14, "periodic")], saved  # the ends of epochs 0 and 1 (the final save: the same step)


def test_the_limit_follows_the_sampler_across_a_resize() -> None:
    sampler = ElasticSampler(SAMPLES, batch_size=BATCH)
    limit = StepLimit(max_epochs=2)
    steps = 0
    for world in (1, 1, 3, 3, 3, 2, 2, 2, 2, 2):  # the world size changes mid-run
        if limit.done(steps, sampler):
            break
        sampler.advance(world)
        steps += 1
    assert sampler.epoch == 2 and sampler.state.consumed < BATCH * 2  # stopped right after crossing into epoch 2
    assert limit.last_step(0, ElasticSampler(SAMPLES, batch_size=BATCH), 2) == 7  # ceil(80 / 12)
    assert StepLimit(max_steps=5, max_epochs=9).last_step(0, sampler, 1) == 5


@pytest.mark.parametrize(("call", "message"), [
    (lambda run: run.batches(max_steps=None), "run.batches() needs max_steps= or max_epochs="),
    (lambda run: run.batches(max_epochs=-1), "max_epochs=-1 must be a whole number"),
    (lambda run: next(iter(run.epochs(1.5))), "max_epochs=1.5 must be a whole number"),
])
def test_bad_limits_are_one_line(call, message: str) -> None:
    with elastic.Run(device="cpu") as run:
        model = torch.nn.Linear(2, 1)
        run.start(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=8, batch_size=2)
        with pytest.raises(UsageError, match=re.escape(message)):
            call(run)
