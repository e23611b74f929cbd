"""benchmarks/slow_rank.py's figures and table on recorded rows (its jobs run in tests/integration)."""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace

import pytest
from support import REPO


def slow_rank():
    name = "slow_rank"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / "slow_rank.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look the module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_throughput_counts_from_the_first_step_to_the_last() -> None:
    steps = [{"step": s, "time": 100.0 + 0.5 * s} for s in range(1, 41)]
    assert slow_rank().throughput(steps, 20, 128) == (20 * 128 / 10.0, 20)
    assert slow_rank().throughput(steps[:10], 20, 128)[1] == 0  # never reached: no figure


def test_a_row_names_the_throttled_rank_from_the_throttles_start_and_counts_false_alarms() -> None:
    bench = slow_rank()
    opts = SimpleNamespace(throttle_after=10, settle=10)
    steps = [{"step": s, "time": 100.0 + s} for s in range(1, 61)]
    events = [{"event": "straggler", "time": 131.5, "step": 31, "rank": 1},
              {"event": "rebalance", "time": 132.0, "step": 32, "shares": [80, 48]},
              {"event": "rebalance", "time": 140.0, "step": 40, "shares": [86, 42]}]
    throttle = SimpleNamespace(started_at=111.0)
    row = bench.summarize(2, "rebalance", steps, events, throttle, opts, (True, "60 steps"))
    assert (row.named_rank, row.seconds_to_named, row.rebalanced, row.exactly_once) == (1, 20.5, [86, 42], True)
    assert row.samples_per_s == 128.0 and row.steps == 18  # from the first split (32) + settle: its steady state
    quiet = bench.summarize(2, "none", steps, events[:1], None, opts, (True, ""))
    assert quiet.false_alarms == 1 and quiet.named_rank is None


def test_the_table_gives_each_mode_its_ratio_to_the_ideal() -> None:
    bench = slow_rank()
    rows = [bench.Row(2, "none", 1000.0, 50, false_alarms=0, exactly_once=True),
            bench.Row(2, "ddp", 500.0, 50),
            bench.Row(2, "rebalance", 700.0, 50, named_rank=1, seconds_to_named=4.2, rebalanced=[86, 42],
                      exactly_once=True)]
    lines = bench.table(rows, 0.5)  # ideal: 1000 x (1 + 0.5) / 2 = 750
    assert lines[1].split() == ["2", "none", "1000", "-", "-", "0", "-", "yes"]
    assert lines[2].split() == ["2", "ddp", "500", "0.67", "-", "-", "-", "-"]
    assert lines[3].split() == ["2", "rebalance", "700", "0.93", "rank", "1", "4.2", "s", "-", "86/42", "yes"]


@pytest.mark.parametrize(("argv", "says"), [
    (["--ranks", "1"], "at least 2"),
    (["--modes", "fast"], "--modes takes"),
    (["--stopped", "1.5"], "between 0 and 1"),
    (["--steps", "10"], "must exceed"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, says, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        slow_rank().parse_args(argv)
    assert stop.value.code == 2 and says in capsys.readouterr().err
