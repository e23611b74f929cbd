"""benchmarks/warm_cold.py's reading of two jobs' event logs, from recorded step times, and its refusals.

The end-to-end run (two jobs of two workers at once) is the benchmark itself: it is what the lead runs on
an idle machine; here only what decides its figure, in one process.
"""

from __future__ import annotations

import math

import pytest
from test_benchmark_tables import refused, script


def steps(first: float, seconds: float, count: int) -> dict[int, float]:
    return {step: first + (step - 1) * seconds for step in range(1, count + 1)}


def test_each_job_is_timed_over_the_window_both_ran_past_their_first_steps() -> None:
    bench = script("warm_cold")
    # The cold job starts 5 s later (its workers import torch) and runs 10 % slower; the warm one ends first.
    warm, cold = steps(100.0, 0.5, 60), steps(105.0, 0.55, 60)
    seconds = bench.window_step_seconds({"warm": warm, "cold": cold}, skip=10)
    assert seconds["warm"] == pytest.approx(0.5) and seconds["cold"] == pytest.approx(0.55)
    # Nothing outside the window counts: a slow start and a job running alone at its end change nothing.
    warm[1], cold[60] = 50.0, 500.0
    assert bench.window_step_seconds({"warm": warm, "cold": cold}, skip=10) == seconds


def test_jobs_that_never_ran_together_are_refused() -> None:
    bench = script("warm_cold")
    with pytest.raises(RuntimeError, match="common window"):
        bench.window_step_seconds({"warm": steps(0.0, 0.5, 30), "cold": steps(100.0, 0.5, 30)}, skip=5)


def test_the_ratio_is_the_geometric_mean_with_a_t_interval() -> None:
    bench = script("warm_cold")
    ratio, low, high = bench.interval([1.0, 1.02, 0.98, 1.0])
    assert ratio == pytest.approx(math.exp(sum(map(math.log, [1.0, 1.02, 0.98, 1.0])) / 4))
    assert low < ratio < high and high - low < 0.06
    assert bench.interval([1.1]) == pytest.approx((1.1, 1.1, 1.1))


@pytest.mark.parametrize("argv", [["--nproc", "1"], ["--steps", "10", "--skip", "10"], ["--rounds", "0"]])
def test_bad_flags_are_refused_before_any_job_starts(capsys, argv) -> None:
    bench = script("warm_cold")
    assert "several workers a node" in refused(capsys, lambda: bench.parse_args(argv))
