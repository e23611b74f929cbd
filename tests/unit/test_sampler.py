from __future__ import annotations

from collections import Counter

import pytest
import torch

from elastic._worker.data.sampler import ElasticSampler, epoch_permutation


def consume(sampler: ElasticSampler, world_size: int, steps: int) -> list[list[int]]:
    """Indices each rank trains on over `steps` steps."""
    per_rank: list[list[int]] = [[] for _ in range(world_size)]
    for _ in range(steps):
        for rank in range(world_size):
            per_rank[rank] += sampler.local_batch(rank, world_size).tolist()
        sampler.advance(world_size)
    return per_rank


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ranks_cover_every_sample_of_an_epoch_exactly_once(world_size: int) -> None:
    sampler = ElasticSampler(96, batch_size=4, seed=7)
    per_rank = consume(sampler, world_size, steps=96 // (4 * world_size))
    seen = [i for rank in per_rank for i in rank]
    assert sorted(seen) == list(range(96))
    assert all(len(r) == len(per_rank[0]) for r in per_rank)
    assert sampler.state.epoch == 1 and sampler.state.consumed == 0


def test_a_batch_crossing_the_epoch_end_is_completed_from_the_next_epoch() -> None:
    sampler = ElasticSampler(10, batch_size=3, seed=1)
    per_rank = consume(sampler, world_size=2, steps=2)  # 12 samples: all of epoch 0, 2 of epoch 1
    flat = per_rank[0][:3] + per_rank[1][:3] + per_rank[0][3:] + per_rank[1][3:]
    assert all(len(r) == 6 for r in per_rank), "every rank gets a full batch"
    assert flat[:10] == epoch_permutation(10, 1, 0).tolist()
    assert flat[10:] == epoch_permutation(10, 1, 1)[:2].tolist()
    assert (sampler.state.epoch, sampler.state.consumed) == (1, 2)


def test_order_is_a_function_of_seed_and_epoch_only() -> None:
    assert torch.equal(epoch_permutation(50, 3, 2), epoch_permutation(50, 3, 2))
    assert not torch.equal(epoch_permutation(50, 3, 2), epoch_permutation(50, 3, 1))
    assert not torch.equal(epoch_permutation(50, 3, 2), epoch_permutation(50, 4, 2))
    a = consume(ElasticSampler(50, batch_size=5, seed=3), world_size=1, steps=10)
    b = consume(ElasticSampler(50, batch_size=5, seed=3), world_size=2, steps=5)
    assert a[0] == [i for step in range(5) for rank in b for i in rank[step * 5 : step * 5 + 5]]


def test_changing_world_size_mid_epoch_still_uses_each_sample_once() -> None:
    sampler = ElasticSampler(60, batch_size=2, seed=0)
    seen = []
    for world_size, steps in [(2, 4), (3, 3), (1, 6), (4, 2)]:  # 16 + 18 + 12 + 16 = 62 samples
        state = sampler.state_dict()
        sampler = ElasticSampler(60, batch_size=2, seed=0)  # a restarted worker
        sampler.load_state_dict(state)
        seen += [i for rank in consume(sampler, world_size, steps) for i in rank]
    counts = Counter(seen[:60])
    assert sorted(counts) == list(range(60)) and set(counts.values()) == {1}


def test_state_from_another_data_set_or_seed_is_refused() -> None:
    state = ElasticSampler(60, batch_size=2, seed=0).state_dict()
    with pytest.raises(ValueError, match="60 samples"):
        ElasticSampler(61, batch_size=2, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="seed 0"):
        ElasticSampler(60, batch_size=2, seed=1).load_state_dict(state)


def test_rank_outside_the_world_is_refused() -> None:
    with pytest.raises(ValueError, match="outside world size 2"):
        ElasticSampler(10, batch_size=1).local_batch(2, 2)
