"""The elastic sampler in ordinary DataLoaders: step samplers, per-sample seeding, safe workers."""

from __future__ import annotations

import os
import pickle
import random
import signal
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from elastic.data import (
    SafeWorkerInit,
    SampleKey,
    StepBatchSampler,
    StepSampler,
    _die_with,
    seeded_samples,
    step_sampler_of,
)
from elastic.launcher.proctree import status
from elastic.sampler import ElasticSampler


class Jittered(Dataset):
    """Sample i is i plus noise from all three global generators: what an augmentation does."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> torch.Tensor:
        noise = torch.rand(()).item() + random.random() + float(np.random.rand())
        return torch.tensor([float(index), noise], dtype=torch.float64)


def replay(sampler: ElasticSampler, rank: int, world_size: int, steps: int) -> list[list[tuple[int, int]]]:
    """What the loop sees: local_batch, then advance; keys carry the epoch of their stream position."""
    out = []
    for _ in range(steps):
        epoch, consumed = sampler.state.epoch, sampler.state.consumed
        local = sampler.local_batch(rank, world_size).tolist()
        first = consumed + rank * sampler.batch_size
        out.append([(epoch + (first + j) // sampler.num_samples, i) for j, i in enumerate(local)])
        sampler.advance(world_size)
    return out


def keys(batches: list[list[SampleKey]]) -> list[list[tuple[int, int]]]:
    return [[(k.epoch, int(k)) for k in batch] for batch in batches]


@pytest.mark.parametrize("rank", [0, 1])
def test_step_batches_are_the_samplers_local_batches_across_epoch_ends(rank: int) -> None:
    sampler = ElasticSampler(10, batch_size=3, seed=7)  # a global batch of 6 straddles epochs
    plan = keys(list(StepBatchSampler(sampler, rank, 2, steps=7)))
    assert sampler.state.consumed == 0, "the plan replays a copy"
    assert plan == replay(sampler, rank, 2, 7)
    other = keys(list(StepBatchSampler(ElasticSampler(10, batch_size=3, seed=7), 1 - rank, 2, steps=7)))
    assert {epoch for batch in plan + other for epoch, _ in batch} == {0, 1, 2, 3, 4}  # 42 samples
    for epoch in range(4):  # complete epochs hold each sample once over both ranks
        assert sorted(i for batch in plan + other for e, i in batch if e == epoch) == list(range(10))


def test_step_batches_start_where_the_sampler_stands_when_iterated() -> None:
    whole = list(StepBatchSampler(ElasticSampler(10, batch_size=3, seed=7), 1, 2, steps=7))
    resumed = ElasticSampler(10, batch_size=3, seed=7)
    batches = StepBatchSampler(resumed, 1, 2, steps=3)  # built first, iterated after the restore
    for _ in range(4):
        resumed.advance(2)
    assert keys(list(batches)) == keys(whole[4:])


def test_without_steps_the_stream_runs_on_and_has_no_length() -> None:
    batches = StepBatchSampler(ElasticSampler(10, batch_size=3, seed=7), 0, 2)
    stream = iter(batches)
    assert len([next(stream) for _ in range(50)]) == 50
    with pytest.raises(TypeError, match="no length"):
        len(batches)


def test_issued_steps_are_taken_back_oldest_first() -> None:
    sampler = ElasticSampler(10, batch_size=3, seed=7)
    batches = StepBatchSampler(sampler, 0, 2)
    stream = iter(batches)
    first, second = next(stream), next(stream)
    assert batches.take_issued() == [int(k) for k in first]
    assert batches.take_issued() == [int(k) for k in second]
    assert batches.take_issued() is None


def test_sample_keys_are_ints_that_survive_pickling() -> None:
    key = SampleKey(4, epoch=3)
    assert key == 4 and torch.arange(10)[key].item() == 4 and [0, 1, 2, 3, 4][key] == 4
    back = pickle.loads(pickle.dumps(key))
    assert (int(back), back.epoch) == (4, 3)


def test_per_sample_sampler_lines_up_with_the_batches() -> None:
    sampler = ElasticSampler(10, batch_size=3, seed=7)
    loader = DataLoader(range(10), sampler=StepSampler(sampler, 1, 2, steps=5), batch_size=3)
    assert [b.tolist() for b in loader] == [[i for _, i in batch] for batch in replay(sampler, 1, 2, 5)]
    assert step_sampler_of(loader) is loader.sampler
    assert isinstance(step_sampler_of(DataLoader(range(10), batch_sampler=StepBatchSampler(sampler, 0, 2))), StepBatchSampler)
    assert step_sampler_of(DataLoader(range(10))) is None


def test_seeded_samples_depend_only_on_seed_epoch_and_index() -> None:
    data = seeded_samples(Jittered(), seed=3)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    first = [data[SampleKey(i, 0)] for i in range(8)]
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2]), "the caller's random streams are untouched"
    torch.manual_seed(12345)
    random.seed(5)
    np.random.seed(5)
    assert all(torch.equal(a, data[SampleKey(i, 0)]) for i, a in enumerate(first))
    assert torch.equal(first[2], data[2]), "a plain int is epoch 0"
    assert all(not torch.equal(a, data[SampleKey(i, 1)]) for i, a in enumerate(first)), "each epoch draws anew"
    assert first[2][0].item() == 2.0


def test_loader_output_does_not_depend_on_its_worker_count() -> None:
    runs = []
    for workers in (0, 2):
        sampler = ElasticSampler(10, batch_size=4, seed=1)
        loader = DataLoader(
            seeded_samples(Jittered(), seed=1), batch_sampler=StepBatchSampler(sampler, 1, 2, steps=6),
            num_workers=workers, worker_init_fn=SafeWorkerInit(os.getpid()) if workers else None,
        )
        runs.append(list(loader))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
    assert runs[0][0].shape == (4, 2)


def test_stateful_dataloader_takes_the_step_sampler() -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    sampler = ElasticSampler(10, batch_size=3, seed=7)
    expected = replay(ElasticSampler(10, batch_size=3, seed=7), 0, 2, 9)
    loader = stateful.StatefulDataLoader(range(10), batch_sampler=StepBatchSampler(sampler, 0, 2, steps=9), num_workers=2)
    assert [b.tolist() for b in loader] == [[i for _, i in batch] for batch in expected]


def test_a_loader_worker_dies_with_its_parent() -> None:
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # the training process, to be killed
        try:
            if os.fork() == 0:  # its loader worker
                _die_with(os.getppid())
                os.write(writer, f"{os.getpid()}\n".encode())
                time.sleep(60)
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as lines:
        worker = int(lines.readline())
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)

    def alive() -> bool:
        return status(worker).get("State", "Z").startswith(("S", "R"))  # gone or a zombie: dead

    deadline = time.monotonic() + 5
    while alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    if alive():
        os.kill(worker, signal.SIGKILL)
        pytest.fail("the orphaned worker lived on")


def test_a_safe_worker_ignores_sigterm_and_runs_the_users_init() -> None:
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            SafeWorkerInit(os.getppid(), then=lambda worker_id: os.write(writer, f"init {worker_id}\n".encode()))(3)
            os.write(writer, b"ready\n")
            time.sleep(2)  # a SIGTERM here is ignored: it lives to exit 0
        finally:
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as lines:
        assert lines.readline() == "init 3\n" and lines.readline() == "ready\n"
        os.kill(child, signal.SIGTERM)
    _, code = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(code) == 0
