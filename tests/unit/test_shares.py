"""The split of a global batch by speed (elastic._worker.data.shares) and the sampler's shares."""

from __future__ import annotations

import pytest

from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.data.shares import balanced_shares, step_time


def test_a_rank_at_half_speed_gets_half_the_samples_of_the_others() -> None:
    assert balanced_shares([2.0, 1.0], 12) == (4, 8)
    assert balanced_shares([1.0, 1.0, 1.0, 2.0], 16) == (5, 5, 4, 2)  # ties to the lower rank
    assert balanced_shares([1.0, 1.0], 8) == (4, 4)
    assert balanced_shares([100.0, 1.0], 4) == (1, 3)  # never below one sample
    assert step_time((4, 8), [2.0, 1.0]) == 8.0 < step_time((6, 6), [2.0, 1.0])


def test_every_split_sums_to_the_global_batch_and_no_split_has_a_shorter_step() -> None:
    for times in ([1.0, 3.0, 7.0], [0.5, 0.5, 0.6], [2.0, 1.1, 1.0]):
        for total in range(len(times), 24):
            shares = balanced_shares(times, total)
            assert sum(shares) == total and min(shares) >= 1
            best = min(step_time((a, b, total - a - b), times)
                       for a in range(1, total) for b in range(1, total - a))
            assert step_time(shares, times) == best, (times, total, shares)


def test_impossible_splits_are_refused() -> None:
    with pytest.raises(ValueError, match="one"):
        balanced_shares([1.0, 1.0, 1.0], 2)
    with pytest.raises(ValueError, match="above 0"):
        balanced_shares([1.0, 0.0], 4)


def test_shares_cut_the_same_global_batch_elsewhere_and_hold_only_at_their_world_size() -> None:
    sampler = ElasticSampler(50, batch_size=4, seed=3)
    even = [sampler.local_batch(r, 2).tolist() for r in range(2)]
    sampler.set_shares((3, 5))
    split = [sampler.local_batch(r, 2).tolist() for r in range(2)]
    assert [len(b) for b in split] == [3, 5] and split[0] + split[1] == even[0] + even[1]
    assert sampler.share(1, 2) == (3, 5) and sampler.share(2, 3) == (8, 4)  # another world size: even
    sampler.advance(2)
    assert sampler.state.consumed == 8


def test_shares_are_saved_and_checked_on_load_and_a_state_without_them_is_as_before() -> None:
    sampler = ElasticSampler(50, batch_size=4, seed=3)
    assert "shares" not in sampler.state_dict()
    sampler.set_shares((2, 6))
    state = sampler.state_dict()
    again = ElasticSampler(50, batch_size=4, seed=3)
    again.load_state_dict(state)
    assert again.shares == (2, 6) and again.local_batch(1, 2).tolist() == sampler.local_batch(1, 2).tolist()
    for bad, why in (([2, 5], "sum to 7"), ([0, 8], "at least 1"), ("26", "not a list"), ([2.0, 6.0], "not a list")):
        with pytest.raises(ValueError, match=why):
            again.load_state_dict({**state, "shares": bad})
    assert again.shares == (2, 6)  # a refused state changes nothing


def test_a_batch_sampler_loader_opened_again_at_new_shares_gives_each_rank_its_share_every_sample_once() -> None:
    from torch.utils.data import DataLoader

    from elastic._worker.data.feed import Feed, StepBatchSampler

    world, steps, change_at = 2, 12, 5
    samplers = [ElasticSampler(30, batch_size=4, seed=1) for _ in range(world)]  # each rank's own copy, as in a job
    feeds = [Feed(DataLoader(list(range(30)), batch_sampler=StepBatchSampler(s, rank, world)), 4)
             for rank, s in enumerate(samplers)]
    trained: list[list[int]] = [[] for _ in range(world)]
    stream: list[int] = []
    for step in range(steps):
        if step == change_at:  # a vote step: every rank takes the same shares, and its loader opens again
            for rank, (sampler, feed) in enumerate(zip(samplers, feeds)):
                sampler.set_shares((6, 2))
                feed.reopen(rank, world)
        whole = samplers[0].global_batch(world).tolist()
        for rank, (sampler, feed) in enumerate(zip(samplers, feeds)):
            expected = sampler.local_batch(rank, world)
            batch = feed.fetch(expected, step=step, until=f"max_steps={steps}")
            feed.check(expected, step=step, rank=rank)  # raises when the loader's batch is not the sampler's
            trained[rank].append(len(batch))
            stream += batch.tolist()
        assert stream[-8:] == whole  # the ranks' batches, in rank order, are the step's global batch
        for sampler in samplers:
            sampler.advance(world)
    assert trained == [[4] * change_at + [6] * (steps - change_at), [4] * change_at + [2] * (steps - change_at)]
    assert sorted(stream[:30]) == list(range(30)) and sorted(stream[30:60]) == list(range(30))  # 2 epochs, each once
    assert all(s.state_dict() == samplers[0].state_dict() for s in samplers)


def test_a_loader_not_opened_again_at_new_shares_is_caught_at_its_next_batch() -> None:
    from torch.utils.data import DataLoader

    from elastic._shared.common.errors import ElasticError
    from elastic._worker.data.feed import Feed, StepBatchSampler

    sampler = ElasticSampler(30, batch_size=4, seed=1)
    feed = Feed(DataLoader(list(range(30)), batch_sampler=StepBatchSampler(sampler, 0, 2)), 4)
    feed.fetch(sampler.local_batch(0, 2), step=0, until="max_steps=5")
    sampler.set_shares((6, 2))
    expected = sampler.local_batch(0, 2)
    feed.fetch(expected, step=0, until="max_steps=5")
    with pytest.raises(ElasticError, match="other samples than the sampler assigns"):
        feed.check(expected, step=0, rank=0)
