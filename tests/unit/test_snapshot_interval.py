"""--snapshot-every auto: Young/Daly's interval from measured costs, capped, steady, agreed."""

from __future__ import annotations

import logging
import math

import pytest

from elastic._worker.checkpoint.snapshot_interval import (
    SnapshotInterval,
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


def clocked(**kwargs) -> tuple[SnapshotInterval, list[float]]:
    now = [0.0]
    settings = {"world_size": 2, "mtbf_hours": 50_000.0, "ckpt_every": 0, "announce": True, **kwargs}
    return SnapshotInterval("auto", clock=lambda: now[0], **settings), now


def run_steps(interval: SnapshotInterval, now: list[float], steps: int, seconds: float) -> None:
    for _ in range(steps):
        now[0] += seconds
        interval.note_step_end()


def test_auto_snapshots_every_step_until_measured_then_takes_daly_in_steps() -> None:
    interval, now = clocked(world_size=4, mtbf_hours=10.0)
    assert (interval.every, interval.proposal()) == (1, 1)
    run_steps(interval, now, 5, 0.5)
    assert interval.proposal() == 1  # no snapshot measured yet
    interval.note_cost(0.2)
    job_mtbf = 10.0 * 3600 / 4
    want = round(daly_interval_s(0.2, job_mtbf) / 0.5)
    assert interval.optimum() == want and interval.proposal() == want > 1


def test_auto_is_capped_at_the_checkpoint_interval_and_a_fixed_setting_never_moves() -> None:
    interval, now = clocked(ckpt_every=7)
    run_steps(interval, now, 3, 0.3)
    interval.note_cost(0.005)
    assert interval.optimum() == 7  # Young/Daly says thousands of steps
    fixed = SnapshotInterval(3, world_size=2, mtbf_hours=1.0, ckpt_every=0, announce=False)
    fixed.note_cost(100.0)
    fixed.note_step_end()
    assert fixed.proposal() == 3
    fixed.agree(9, step=4)  # agreed values are what every rank proposed: the same fixed setting
    assert fixed.every == 9


def test_small_changes_are_not_proposed_and_agree_logs_a_change_once(caplog) -> None:
    interval, now = clocked(ckpt_every=100)
    run_steps(interval, now, 3, 0.3)
    interval.note_cost(0.005)
    with caplog.at_level(logging.INFO, logger="elastic._worker.checkpoint.snapshot_interval"):
        interval.agree(interval.proposal(), step=3)
        interval.agree(100, step=4)  # no change: no line
    assert interval.every == 100 and interval.chosen == [(3, 100)]
    assert caplog.text.count("in-memory snapshots every 100 steps (--snapshot-every auto") == 1
    assert "capped at --ckpt-every 100" in caplog.text
    # A step time that moves the optimum by less than 25 % keeps the interval.
    interval, now = clocked(mtbf_hours=1.0)
    run_steps(interval, now, 3, 1.0)
    interval.note_cost(1.0)
    best = interval.optimum()
    interval.agree(best, step=3)
    run_steps(interval, now, 40, 1.1)  # the window is all 1.1 s steps now
    assert interval.optimum() != best and interval.proposal() == best
    run_steps(interval, now, 40, 3.0)
    assert interval.proposal() == interval.optimum() != best


def test_zero_means_no_rank_snapshots_and_changes_nothing() -> None:
    interval, _ = clocked()
    interval.agree(0, step=5)
    assert interval.every == 1 and interval.chosen == []
