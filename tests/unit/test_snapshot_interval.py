"""--snapshot-every auto: as often as 1 % of the loop buys, at most Young/Daly's and --ckpt-every apart,
steady, agreed."""

from __future__ import annotations

import logging
import math

import pytest

from elastic._worker.checkpoint.snapshot_interval import (
    BUDGET,
    REPLICA_BUDGET,
    SnapshotInterval,
    budget_every,
    daly_interval_s,
)


def test_daly_is_young_to_first_order_and_never_beyond_the_mtbf() -> None:
    cost, mtbf = 0.01, 3600.0 * 1000
    young = math.sqrt(2 * cost * mtbf)
    assert daly_interval_s(cost, mtbf) == pytest.approx(young, rel=1e-3)
    # A costly snapshot against frequent failures: Daly's correction terms matter, and T stays below M.
    assert daly_interval_s(50.0, 1000.0) == pytest.approx(
        math.sqrt(2 * 50 * 1000) * (1 + math.sqrt(50 / 2000) / 3 + (50 / 2000) / 9) - 50
    )
    assert daly_interval_s(3000.0, 1000.0) == 1000.0
    assert daly_interval_s(0.0, 1000.0) == 0.0


def test_the_budget_buys_the_fewest_steps_whose_snapshots_cost_at_most_one_percent() -> None:
    assert BUDGET == 0.01
    step = 0.25
    assert budget_every(0.0015, step) == 1  # 0.6 % of a step: every step
    assert budget_every(0.0025, step) == 1  # exactly 1 %: still every step (no rounding up past the boundary)
    assert budget_every(0.0026, step) == 2  # just over: every other step (0.52 %)
    assert budget_every(0.025, step) == 10  # 10 % of a step: every 10th (1 %)
    assert budget_every(0.0251, step) == 11
    for cost in (0.001, 0.004, 0.03, 0.3, 3.0):
        every = budget_every(cost, step)
        assert cost / (every * step) <= BUDGET + 1e-12  # within the budget...
        assert every == 1 or cost / ((every - 1) * step) > BUDGET  # ...and the fewest steps that are
    assert budget_every(0.0, step) == budget_every(0.01, 0.0) == 1  # nothing measured: every step


def clocked(setting: int | str = "auto", **kwargs) -> tuple[SnapshotInterval, list[float]]:
    now = [0.0]
    settings = {"world_size": 2, "mtbf_hours": 50_000.0, "ckpt_every": 0, "announce": True, **kwargs}
    return SnapshotInterval(setting, clock=lambda: now[0], **settings), now


def run_steps(interval: SnapshotInterval, now: list[float], steps: int, seconds: float) -> None:
    for _ in range(steps):
        now[0] += seconds
        interval.note_step_end()


def test_at_the_recipes_default_size_auto_snapshots_every_step(caplog) -> None:
    """The GPT recipe's default: a 247 ms step, snapshots well under 1 % of it, failures as Llama 3's."""
    interval, now = clocked(ckpt_every=50)
    assert (interval.every, interval.proposal()) == (1, 1)  # every step until measured
    with caplog.at_level(logging.INFO, logger="elastic._worker.checkpoint.snapshot_interval"):
        interval.agree(1, step=1)  # nothing measured yet: nothing to say
        run_steps(interval, now, 20, 0.247)
        for _ in range(20):
            interval.note_cost(0.0019)
        assert interval.young_daly() > 1000  # Young/Daly alone would snapshot every ~4,000 steps
        assert interval.optimum() == 1 and interval.proposal() == 1
        for step in (20, 21):
            interval.agree(1, step=step)  # no change: the measured choice is said once all the same
    assert caplog.text.count("in-memory snapshots every 1 step(s) (--snapshot-every auto: a snapshot costs the loop 1.9 ms") == 1
    assert interval.chosen == []
    # Were it 3x dearer (a loaded host), every third step: within the budget, never over it.
    for _ in range(40):
        interval.note_cost(0.0057)
    assert interval.proposal() == 3


def test_the_copy_to_the_peer_node_has_a_budget_of_its_own() -> None:
    """The peer-replica tier's cost (its tag and send on the snapshot thread) is budgeted apart: the interval
    is the larger of the two tiers'."""
    interval, now = clocked(ckpt_every=50)
    run_steps(interval, now, 20, 0.247)
    for _ in range(20):
        interval.note_cost(0.0019, 0.0011)  # both within 1 %: every step
    assert interval.budgets() == interval.proposal() == 1
    for _ in range(40):
        interval.note_cost(0.0019, 0.0030)  # the copy alone is 1.2 %: every other step
    assert REPLICA_BUDGET == 0.01 and interval.budgets() == interval.proposal() == 2
    assert "and its copy to the peer node 3.0 ms, 1.21%; 1% of the loop for each buys one every 2 step(s)" \
        in interval.describe()


def test_young_daly_bounds_the_interval_when_failures_come_often() -> None:
    """A costly snapshot (a 10-step budget interval) on a job failing every ~20 s of steps: Daly's optimum
    is shorter than what the budget buys, and it wins (the failures' redone work outweighs the cost)."""
    interval, now = clocked(world_size=1, mtbf_hours=60.0 / 3600)  # a failure a minute
    run_steps(interval, now, 10, 1.0)
    interval.note_cost(0.5)  # 50 % of a step: the budget buys one every 50 steps
    assert budget_every(0.5, 1.0) == 50
    daly = round(daly_interval_s(0.5, 60.0))
    assert interval.young_daly() == daly < 50
    assert interval.optimum() == daly == interval.proposal()


def test_auto_is_capped_at_the_checkpoint_interval_and_a_fixed_setting_never_moves() -> None:
    interval, now = clocked(ckpt_every=7)
    run_steps(interval, now, 3, 0.3)
    interval.note_cost(0.1)  # a third of a step: the budget buys one every 34 steps
    assert interval.optimum() == 7
    fixed = SnapshotInterval(3, world_size=2, mtbf_hours=1.0, ckpt_every=0, announce=False)
    fixed.note_cost(100.0)
    fixed.note_step_end()
    assert fixed.proposal() == 3
    fixed.agree(9, step=4)  # agreed values are what every rank proposed: the same fixed setting
    assert fixed.every == 9


def test_small_changes_are_not_proposed_and_agree_logs_a_change_once(caplog) -> None:
    interval, now = clocked(ckpt_every=100)
    run_steps(interval, now, 3, 0.3)
    interval.note_cost(0.3)  # a whole step: the budget buys one every 100 steps, the cap too
    with caplog.at_level(logging.INFO, logger="elastic._worker.checkpoint.snapshot_interval"):
        interval.agree(interval.proposal(), step=3)
        interval.agree(100, step=4)  # no change: no line
    assert interval.every == 100 and interval.chosen == [(3, 100)]
    assert caplog.text.count("in-memory snapshots every 100 step(s) (--snapshot-every auto") == 1
    assert "a snapshot costs the loop 300.0 ms, 100.00% of a 300 ms step; 1% of the loop buys one every 100 step(s)" \
        in caplog.text
    # A step time that moves the optimum by less than 25 % keeps the interval.
    interval, now = clocked()
    run_steps(interval, now, 3, 1.0)
    interval.note_cost(0.1)  # 10 steps
    interval.agree(interval.proposal(), step=3)
    assert interval.every == 10
    run_steps(interval, now, 40, 1.15)  # 9 steps now: within 25 %
    assert interval.optimum() == 9 and interval.proposal() == 10
    run_steps(interval, now, 40, 2.0)  # 5 steps
    assert interval.proposal() == interval.optimum() == 5


def test_zero_means_no_rank_snapshots_and_changes_nothing() -> None:
    interval, _ = clocked()
    interval.agree(0, step=5)
    assert interval.every == 1 and interval.chosen == []
