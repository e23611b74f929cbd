"""Which rank is a straggler (elastic._worker.observe.stragglers): recorded figures in, episodes out."""

from __future__ import annotations

import random

import pytest

from elastic._worker.observe.stragglers import (
    MAX_FIGURE,
    StragglerWatch,
    WorkClock,
    slowdowns,
)


def test_slowdown_is_work_over_the_median_of_the_others() -> None:
    assert slowdowns([1000, 2000]) == [0.5, 2.0]
    assert slowdowns([1000, 1000, 1000, 3000]) == [1.0, 1.0, 1.0, 3.0]
    assert slowdowns([1000, 0, 1000]) == [1.0, None, 1.0]  # no figure: left out, compared with nobody
    assert slowdowns([1000]) == [None]


def test_a_peer_figure_that_is_no_count_of_microseconds_is_no_figure() -> None:
    assert slowdowns([1000, -5, MAX_FIGURE + 1, True, 2000]) == [0.5, None, None, None, 2.0]  # type: ignore[list-item]


def test_the_slow_rank_is_named_once_when_its_window_is_slow_and_once_when_it_recovers() -> None:
    watch = StragglerWatch(factor=1.25, window=3)
    assert watch.observe([1000, 1000, 2000, 1000]) == []  # one vote: the window is not full yet
    assert watch.observe([1000, 1000, 2000, 1000]) == []
    [episode] = watch.observe([1000, 1000, 2000, 1000])
    assert (episode.rank, episode.started, episode.slowdown) == (2, True, 2.0)
    assert watch.slow == {2: 2.0}
    for _ in range(5):  # still slow: reported once per episode, not at every vote
        assert watch.observe([1000, 1000, 2100, 1000]) == []
    assert watch.observe([1000, 1000, 1000, 1000]) == []  # the median of the window is still slow
    [back] = watch.observe([1000, 1000, 1000, 1000])
    assert (back.rank, back.started) == (2, False) and back.slowdown < watch.recover_below
    assert watch.slow == {}


def test_no_episode_on_an_even_job_under_noise_and_spikes() -> None:
    rng = random.Random(7)
    watch = StragglerWatch(factor=1.25, window=5)
    crossed = 0
    for vote in range(2000):
        figures = [round(10_000 * rng.uniform(0.88, 1.12)) for _ in range(4)]
        if vote % 7 == 0:
            figures[rng.randrange(4)] *= 3  # one vote's spike (a collection, a page fault) on some rank
        crossed += any(s is not None and s >= watch.factor for s in slowdowns(figures))
        assert watch.observe(figures) == [], f"vote {vote}: {figures}"
    assert crossed > 200  # single votes do cross the factor: the window is what keeps them quiet


def test_between_the_thresholds_no_flapping() -> None:
    watch = StragglerWatch(factor=1.25, window=1)
    assert [e.started for e in watch.observe([1000, 1300])] == [True]
    assert watch.observe([1000, 1200]) == []  # below the factor, above recover_below (1.125)
    assert watch.observe([1000, 1250]) == []
    assert [e.started for e in watch.observe([1000, 1100])] == [False]


def test_a_group_of_another_size_forgets_the_ranks_gone_and_reset_forgets_all() -> None:
    watch = StragglerWatch(factor=1.25, window=1)
    watch.observe([1000, 1000, 3000])
    assert watch.slow == {2: 3.0}
    watch.observe([1000, 1000])
    assert watch.slow == {}
    watch.observe([1000, 3000])
    watch.reset()
    assert watch.slow == {} and watch.current(1) is None


def test_settings_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="above 1"):
        StragglerWatch(factor=1.0, window=3)
    with pytest.raises(ValueError, match="at least 1"):
        StragglerWatch(factor=1.5, window=0)
    with pytest.raises(ValueError, match="between 1 and"):
        StragglerWatch(factor=1.5, window=2, recover_below=1.6)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_work_ends_at_the_last_gradient_not_at_the_step_end() -> None:
    clock = FakeClock()
    work = WorkClock(clock)
    for _ in range(2):
        work.started()
        clock.now += 0.010
        work.arrived()
        clock.now += 0.020
        work.arrived()  # the last gradient: the all-reduce waits for it
        clock.now += 0.500  # waiting for a slower peer in the all-reduce, the optimizer step
        work.ended(samples=4)
    assert work.take() == 30_000_000 // 4  # nanoseconds per sample
    assert work.take() == 0  # nothing since the last take


def test_a_step_without_backward_counts_to_its_end_and_a_stray_arrival_counts_nothing() -> None:
    clock = FakeClock()
    work = WorkClock(clock)
    work.arrived()  # outside a step (evaluation's backward, say)
    work.ended(samples=2)
    assert work.take() == 0
    work.started()
    clock.now += 0.004
    work.ended(samples=2)
    assert work.take() == 2_000_000


def test_a_ranks_straggler_lines_come_at_most_once_a_minute_and_count_what_was_held_back() -> None:
    """On a busy shared machine episodes start and end every few seconds: each is an event, but rank 0
    says one line a minute per rank, the next one counting the episodes held back since."""
    from elastic._worker.observe.stragglers import LineBudget

    now = [0.0]
    budget = LineBudget(interval=60.0, clock=lambda: now[0])
    assert budget.start(1) == 0 and budget.end(1)  # the first episode: its start and its end said
    for t in (5.0, 12.0, 30.0):  # three more within the minute: held back, and their ends too
        now[0] = t
        assert budget.start(1) is None and not budget.end(1)
    assert budget.start(2) == 0  # another rank has its own minute
    now[0] = 61.0
    assert budget.start(1) == 3  # said, with the three held back
    assert budget.end(1) and not budget.end(1)  # an end is said once, after a start that was
