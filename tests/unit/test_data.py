"""The elastic sampler in ordinary DataLoaders: step samplers, per-sample seeding, safe workers."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch
from support import Jittered, replay
from torch.utils.data import DataLoader

from elastic._worker.data.feed import (
    SampleKey,
    StepBatchSampler,
    StepSampler,
    seeded_samples,
    step_sampler_of,
)
from elastic._worker.data.sampler import ElasticSampler


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
