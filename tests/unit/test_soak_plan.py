"""benchmarks/soak.py's figures from event logs made by hand: the window, the stall, the time lost (redone
steps, slow first steps, smaller-world steps and join pauses count), the path, and the bound."""

from __future__ import annotations

from typing import Any

import pytest
from test_benchmark_tables import refused, script

D = 0.25  # a steady step


def steps(first: int, last: int, *, at: float, world: int = 2, every: float = D) -> list[dict[str, Any]]:
    return [{"event": "step", "step": s, "time": at + (s - first) * every, "world_size": world}
            for s in range(first, last + 1)]


BEFORE = steps(1, 20, at=10.25)  # step 20 ends at 15.0
KILL = [{"time": 15.1, "rank": 1, "node": 1, "hit": "mid_step"}]


def test_a_heal_in_place_loses_its_stall_and_nothing_else():
    measure = script("soak_measure")
    healed = [{"event": "failure", "step": 20, "time": 15.15, "rank": 1, "exitcode": -9},
              {"event": "restore", "step": 20, "time": 15.5, "source": "live", "redone": 0},
              {"event": "heal", "step": 20, "time": 15.5, "change": "heal"}, *steps(21, 30, at=15.85)]
    records = BEFORE + healed
    assert measure.steady_step(records, 15.1, 2) == pytest.approx(D)
    got = measure.measure(records, kind="mid_step", kills=KILL, full=2, d=D)
    assert (got.begin, got.end) == (15.0, pytest.approx(15.85))
    assert got.stall_s == pytest.approx(0.85 - D)
    assert got.time_lost_s == pytest.approx(0.85 - D), "one full-size step trained in the window"
    assert (got.redone, got.path, got.sources) == (0, ["heal"], ["live"])


def test_steps_redone_count_as_lost_until_the_job_is_back_where_it_was():
    """A restart from a snapshot of step 18: steps 19 and 20 are trained again (not progress), so the
    window ends only past step 20, and they count as lost beside the stall."""
    measure = script("soak_measure")
    restart = [{"event": "restore", "step": 18, "time": 16.0, "source": "memory", "redone": 2},
               {"event": "start", "step": 18, "time": 16.0}, *steps(19, 30, at=16.4)]
    got = measure.measure(BEFORE + restart, kind="mid_step", kills=KILL, full=2, d=D)
    assert got.end == pytest.approx(16.9), "the first steady run past step 20 starts at step 21"
    assert got.stall_s == pytest.approx(1.4 - D)
    assert got.time_lost_s == pytest.approx(1.9 - D), "1.9 s for one step's progress: the stall plus two redone"
    assert (got.redone, got.redone_estimated, got.path, got.sources) == (2, False, ["round"], ["memory"])
    no_figure = [{**restart[0], "redone": None}, *restart[1:]]
    no_figure[0].pop("redone")
    estimated = measure.measure(BEFORE + no_figure, kind="mid_step", kills=KILL, full=2, d=D)
    assert (estimated.redone, estimated.redone_estimated) == (2, True), "the newest step logged less the restored"


def test_training_on_counts_the_smaller_worlds_steps_at_their_size_and_the_join_pause():
    measure = script("soak_measure")
    train_on = [{"event": "restore", "step": 20, "time": 15.3, "source": "live", "redone": 0},
                {"event": "heal", "step": 20, "time": 15.3, "change": "shrink"},
                *steps(21, 28, at=15.55, world=1),  # half the samples a step
                {"event": "restore", "step": 28, "time": 18.1, "source": "live", "redone": 0},
                {"event": "heal", "step": 28, "time": 18.1, "change": "grow", "seconds": 0.3},
                *steps(29, 40, at=18.35)]
    got = measure.measure(BEFORE + train_on, kind="mid_step", kills=KILL, full=2, d=D)
    assert got.end == pytest.approx(18.35), "steady once grown back: the grow's own step is the first of the run"
    assert got.path == ["shrink", "grow"] and got.sources == ["live", "live"]
    assert got.time_lost_s == pytest.approx((18.35 - 15.0) - D * (8 * 0.5 + 1))
    assert got.stall_s == pytest.approx(18.35 - 17.3 - D), "the join's pause is the longest gap"


def test_a_killed_rank_0s_unlogged_step_counts_as_trained():
    """Rank 0 completed step 21 but died before it logged it (a step's line goes out one step late):
    the restore from its peer says the job had come to 21."""
    measure = script("soak_measure")
    healed = [{"event": "restore", "step": 21, "time": 15.6, "source": "live", "redone": 0},
              {"event": "start", "step": 21, "time": 15.6}, *steps(22, 30, at=15.9)]
    got = measure.measure(BEFORE + healed, kind="mid_step", kills=[{**KILL[0], "time": 15.3}], full=2, d=D)
    assert got.path == ["heal"], "a replacement at rank 0 writes the live restore and its start, not a round"
    assert got.stall_s == pytest.approx(0.65 - D), "step 21 ended about a steady step after step 20"
    assert got.time_lost_s == pytest.approx(0.9 - 2 * D)


def test_a_job_that_never_trains_steadily_again_is_not_recovered_and_over_the_bound():
    measure = script("soak_measure")
    stuck = [{"event": "restore", "step": 20, "time": 15.5, "source": "live"}, *steps(21, 22, at=15.8)]
    got = measure.measure(BEFORE + stuck, kind="vote", kills=KILL, full=2, d=D)
    assert not got.recovered and got.time_lost_s is None
    fine = measure.Incident(kind="mid_step", kills=KILL, steady_step_s=D, begin=15.0, end=16.0, stall_s=0.5,
                            time_lost_s=0.6)
    slow = measure.Incident(kind="mid_step", kills=KILL, steady_step_s=D, begin=15.0, end=20.0, stall_s=3.5,
                            time_lost_s=1.0)
    costly = measure.Incident(kind="mid_step", kills=KILL, steady_step_s=D, begin=15.0, end=20.0, stall_s=1.0,
                              time_lost_s=1.7)
    summary = measure.summary([fine, fine, slow, costly, got])
    assert summary["over_bound"] == [2, 3, 4], "a stall over 3 s, time lost over twice the median, never steady"
    assert summary["time_lost_s"] == {"median": pytest.approx(0.8), "p99": 1.7, "max": 1.7}
    assert (summary["incidents"], summary["unrecovered"]) == (5, 1)


def test_quantiles_take_the_nearest_rank():
    measure = script("soak_measure")
    values = [float(v) for v in range(1, 101)]
    assert measure.quantiles(values) == {"median": 50.5, "p99": 99.0, "max": 100.0}
    assert measure.quantiles([2.0]) == {"median": 2.0, "p99": 2.0, "max": 2.0}


def test_a_kills_time_line_names_the_kill_the_events_and_the_long_gaps():
    measure = script("soak_measure")
    records = BEFORE + [{"event": "restore", "step": 20, "time": 15.5, "source": "live", "redone": 0},
                        *steps(21, 30, at=19.0)]
    incident = measure.measure(records, kind="mid_step", kills=KILL, full=2, d=D)
    line = measure.time_line(records, [(15.2, "torchrevive-run: worker rank 1 failed")], incident)
    assert line[0] == "   +0.00 s  SIGKILL rank 1 (node 1, mid_step)"
    assert any("torchrevive-run: worker rank 1 failed" in x and x.startswith("   +0.10 s") for x in line), line
    assert any("step 21 at world size 2, 4.00 s after step 20" in x for x in line), line


def test_the_soak_refuses_an_unknown_setting_or_kind_in_one_line(capsys):
    soak = script("soak")
    assert "--settings takes restart, keep, train-on" in refused(capsys, lambda: soak.main(["--settings", "fast"]))
    assert "--kinds mid_step" in refused(capsys, lambda: soak.main(["--kinds", "lunch"]))
