"""elastic.Run in one process: what it saves and restores, its loop, its refusals."""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import elastic
from elastic._shared.common.errors import (
    CheckpointMismatchError,
    ElasticError,
    Preempted,
    UsageError,
)
from elastic._worker.config import RunConfig
from elastic._worker.data.feed import StepBatchSampler
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.observe.events import read_events
from elastic._worker.runtime.parallel import unwrap


class Counter:
    """Extra user state: anything with state_dict/load_state_dict."""

    def __init__(self) -> None:
        self.seen = 0
        self.total = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "total": self.total.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen, self.total = int(state["seen"]), state["total"].clone()


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(40, 3, generator=generator), torch.randn(40, 1, generator=generator))


def train(tmp_path: Path, max_steps: int, *, extra: dict[str, Any] | None = None, loader: bool = True, **settings: Any) -> tuple[torch.nn.Module, dict]:
    """A small loop on the front door; returns the model and the run's summary."""
    dataset = data()
    config = {"seed": 3, "ckpt_dir": str(tmp_path / "ckpt"), "ckpt_every": 3, "events": str(tmp_path / "events.jsonl"),
              "device": "cpu", **settings}
    with elastic.Run(**config) as run:
        model = run.ddp(torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        run.start(model=model, optimizer=optimizer, data=dataset, batch_size=4, extra=extra)
        source = DataLoader(dataset, batch_sampler=run.batch_sampler()) if loader else None
        for batch in run.batches(source, max_steps=max_steps):
            x, y = batch if loader else dataset[batch]
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            for obj in (e for e in (extra or {}).values() if isinstance(e, Counter)):
                obj.seen += len(x)
                obj.total += x.sum(dim=0)
            run.log(loss)
        summary = run.finish()
    return model, summary


def test_an_interrupted_run_with_extra_state_ends_identical_to_one_run_through(tmp_path: Path) -> None:
    straight, counter = tmp_path / "straight", Counter()
    model, summary = train(straight, 12, extra={"counter": counter})
    assert summary["step"] == 12 and summary["rank"] == 0 and summary["loss"] == summary["loss"]  # not nan

    split, first = tmp_path / "split", Counter()
    train(split, 6, extra={"counter": first})
    resumed = Counter()
    model2, _ = train(split, 12, extra={"counter": resumed})
    assert resumed.seen == counter.seen == 12 * 4, "the extra state came back with the checkpoint"
    assert torch.equal(resumed.total, counter.total)
    for (name, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), name
    events = list(read_events(split / "events.jsonl"))
    assert [e["step"] for e in events if e["event"] == "restore"] == [6]
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(1, 13))
    assert all("loss" in e for e in events if e["event"] == "step"), "every step's loss was read out"


def test_a_checkpoint_with_other_extra_state_is_refused_in_one_line(tmp_path: Path) -> None:
    train(tmp_path, 3, extra={"counter": Counter()})
    with pytest.raises(CheckpointMismatchError, match=r"holds extra state \['counter'\], this run registers \['ema'\]"):
        train(tmp_path, 6, extra={"ema": Counter()})


def test_extra_state_needs_state_dict_and_load_state_dict(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="extra state 'steps' \\(int\\) has no state_dict"):
        train(tmp_path, 3, extra={"steps": 5})


def test_without_a_loader_the_batches_are_the_samplers_indices(tmp_path: Path) -> None:
    seen = []
    with elastic.Run(seed=1, device="cpu") as run:
        model = torch.nn.Linear(2, 1)
        run.start(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=10, batch_size=3)
        for indices in run.batches(max_steps=5):
            seen.append(indices.tolist())
    expected = ElasticSampler(10, batch_size=3, seed=1)
    for indices in seen:
        assert indices == expected.local_batch(0, 1).tolist()
        expected.advance(1)
    assert run.step == 5 and run.epoch == 1 and run.epochs_done == pytest.approx(1.5)


def test_a_loader_that_runs_dry_or_strays_from_the_sampler_is_an_error(tmp_path: Path) -> None:
    dataset = data()
    with pytest.raises(ElasticError, match="the data loader ended at step 2, before max_steps=5"):
        with elastic.Run(device="cpu") as run:
            model = torch.nn.Linear(3, 1)
            run.start(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=dataset, batch_size=4)
            for _ in run.batches(DataLoader(dataset, batch_size=4, sampler=range(8)), max_steps=5):
                pass
    with pytest.raises(ElasticError, match="step 1: the data loader produced other samples"):
        with elastic.Run(device="cpu", seed=2) as run:
            model = torch.nn.Linear(3, 1)
            run.start(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=dataset, batch_size=4)
            stray = StepBatchSampler(run.sampler, 1, 2)  # another rank's share
            for _ in run.batches(DataLoader(dataset, batch_sampler=stray), max_steps=2):
                pass


def test_sigterm_commits_the_step_and_raises_preempted(tmp_path: Path) -> None:
    with pytest.raises(Preempted, match="stopped by SIGTERM after step 4; checkpoint committed"):
        with elastic.Run(device="cpu", ckpt_dir=str(tmp_path / "ckpt"), events=str(tmp_path / "ev.jsonl")) as run:
            model = torch.nn.Linear(2, 1)
            run.start(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=16, batch_size=2)
            for _ in run.batches(max_steps=100):
                if run.step == 3:
                    os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))
    saved = [e for e in read_events(tmp_path / "ev.jsonl") if e["event"] == "checkpoint"]
    assert [(e["step"], e["reason"]) for e in saved] == [(4, "preemption")]
    assert not [e for e in read_events(tmp_path / "ev.jsonl") if e["event"] == "end"]


def test_due_counts_only_steps_this_run_did(tmp_path: Path) -> None:
    train(tmp_path, 3)
    due = []
    with elastic.Run(device="cpu", seed=3, ckpt_dir=str(tmp_path / "ckpt")) as run:
        model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
        run.start(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01), data=data(), batch_size=4)
        for _ in run.batches(max_steps=9):
            due.append((run.step, run.due(3)))
    assert due == [(3, False), (4, False), (5, False), (6, True), (7, False), (8, False)]


def test_a_process_group_the_script_made_is_adopted_and_left_up(tmp_path: Path) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with elastic.Run(device="cpu") as run:
            assert run.distributed and run.world_size == 1
            model = run.ddp(torch.nn.Linear(2, 1))
            assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
            run.start(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=8, batch_size=2)
            for _ in run.batches(max_steps=2):
                pass
        assert dist.is_initialized(), "the script's own group is the script's to destroy"
    finally:
        dist.destroy_process_group()


def test_config_from_args_takes_the_contract_flags() -> None:
    parser = argparse.ArgumentParser()
    elastic.add_runtime_arguments(parser, ckpt_every=7, seed=5)  # this script's own defaults
    config = RunConfig.from_args(parser.parse_args(["--ckpt-dir", "d", "--metrics-port", "9100", "--hang-timeout", "0"]))
    assert (config.seed, config.ckpt_dir, config.ckpt_every, config.metrics_port, config.hang_timeout) == (5, "d", 7, 9100, 0.0)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"ckpt_keep": 1}, "ckpt_keep=1 must be at least 2"),
        ({"ckpt_every": -1}, "ckpt_every=-1 must be a number of steps, 0 or more, or of epochs"),
        ({"metrics_port": 70000}, "metrics_port=70000 is not a port number"),
        ({"term_grace": 0}, "term_grace must be above 0"),
    ],
)
def test_bad_settings_are_one_line(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        RunConfig(**settings)


def test_wrappers_are_unwrapped_and_sharded_ones_refused() -> None:
    inner = torch.nn.Linear(2, 2)
    assert unwrap(torch.compile(inner)) is inner

    class FullyShardedDataParallel(torch.nn.Linear):
        pass

    with pytest.raises(UsageError, match="FSDP"):
        unwrap(FullyShardedDataParallel(2, 2))


def test_the_loop_must_start_first() -> None:
    with elastic.Run(device="cpu") as run:
        with pytest.raises(RuntimeError, match="call Run.start"):
            run.batch_sampler()


class NumpyBest:
    """Extra state holding a numpy scalar: saves with torch.save, but no weights_only load reads it."""

    def __init__(self) -> None:
        self.best = np.float64(1.5)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state["best"]


class Picky(Counter):
    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise KeyError("total")


def test_extra_state_that_could_not_be_loaded_back_fails_at_save_time(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"extra state 'best': state_dict\(\)\['best'\] is a numpy.float64"):
        train(tmp_path, 3, extra={"best": NumpyBest()})
    assert not list((tmp_path / "ckpt").glob("step_*")), "nothing was committed"


def test_extra_state_refused_by_its_object_changes_nothing(tmp_path: Path) -> None:
    train(tmp_path, 3, extra={"counter": Counter()})
    with elastic.Run(device="cpu", seed=3, ckpt_dir=str(tmp_path / "ckpt")) as run:
        model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(CheckpointMismatchError, match="extra state 'counter' does not load \\(KeyError"):
            run.start(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01), data=data(), batch_size=4,
                      extra={"counter": Picky()})
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "the model was not touched"


def test_break_after_the_optimizer_step_counts_that_step(tmp_path: Path) -> None:
    dataset = data()
    with elastic.Run(device="cpu", seed=3, ckpt_dir=str(tmp_path / "ckpt")) as run:
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        run.start(model=model, optimizer=optimizer, data=dataset, batch_size=4)
        for x, y in run.batches(DataLoader(dataset, batch_sampler=run.batch_sampler()), max_steps=10):
            if run.step == 5:
                break  # before training on the 6th batch: not a step
        for x, y in run.batches(DataLoader(dataset, batch_sampler=run.batch_sampler()), max_steps=10):
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if run.step == 6:
                break  # after training on the 7th: a step
        assert run.step == 7 and run.sampler.state.consumed == 28
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("step_*"))
    assert saved[-1] == "step_00000007"


def test_a_pause_whose_group_broke_voids_the_step_only_before_its_update(tmp_path: Path) -> None:
    """A peer died in a pause's collective (elastic._worker.runtime.collectives) of a run that heals in place:
    the step the script holds is void only when its update is still to come. After the update, a void step's
    undo would not take the update back, and the step would be trained twice; outside the loop there is
    no step to void."""
    from types import SimpleNamespace

    from elastic._worker.runtime import collectives

    voided: list[str] = []
    healing = SimpleNamespace(can_heal=True, void_step=voided.append)

    def broken_pause(run: elastic.Run) -> None:
        real, run.core.survivors = run.core.survivors, healing  # this pause only: the loop's own steps are a plain run's
        try:
            with run.pause():
                collectives._current.broken = "Connection closed by peer"  # as a failed all_reduce_mean leaves it
        finally:
            run.core.survivors = real

    with elastic.Run(device="cpu", seed=3) as run:
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        run.start(model=model, optimizer=optimizer, data=16, batch_size=2)
        broken_pause(run)  # before the loop
        for indices in run.batches(max_steps=2):
            if run.step == 0:
                broken_pause(run)  # an evaluation at the top of the body
                assert voided == ["Connection closed by peer"]
            model(torch.ones(len(indices), 2)).sum().backward()
            optimizer.step()
            if run.step == 1:
                broken_pause(run)  # one after the update
        broken_pause(run)  # after the loop
        assert voided == ["Connection closed by peer"] and run.step == 2


def test_a_loader_batch_size_other_than_the_runs_is_one_line(tmp_path: Path) -> None:
    dataset = data()
    with pytest.raises(UsageError, match=r"DataLoader\(batch_size=3\) with run.sampler_for_loader\(\) must take .* \(4\)"):
        with elastic.Run(device="cpu") as run:
            model = torch.nn.Linear(3, 1)
            run.start(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=dataset, batch_size=4)
            for _ in run.batches(DataLoader(dataset, sampler=run.sampler_for_loader(), batch_size=3), max_steps=2):
                pass


def test_sigterm_during_a_pause_waits_for_it_then_commits_the_step(tmp_path: Path) -> None:
    with pytest.raises(Preempted, match="after step 3"):
        with elastic.Run(device="cpu", ckpt_dir=str(tmp_path / "ckpt"), term_grace=0.2,
                         events=str(tmp_path / "ev.jsonl")) as run:
            model = torch.nn.Linear(2, 1)
            run.start(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=16, batch_size=2)
            for _ in run.batches(max_steps=100):
                if run.step == 3:
                    with run.pause():  # an evaluation longer than the grace
                        os.kill(os.getpid(), signal.SIGTERM)
                        time.sleep(1.0)
    saved = [e for e in read_events(tmp_path / "ev.jsonl") if e["event"] == "checkpoint"]
    assert [(e["step"], e["reason"]) for e in saved] == [(3, "preemption")]


def test_the_summary_breaks_the_runtime_cost_down(tmp_path: Path) -> None:
    from elastic._worker.observe.step_costs import PHASES

    _, summary = train(tmp_path, 9)
    costs = summary["step_costs"]
    assert set(costs) == set(PHASES) and all(seconds >= 0 for seconds in costs.values()), costs
    assert costs["sampler"] > 0 and costs["report"] > 0 and costs["vote"] > 0 and costs["checkpoint"] > 0, costs

