"""benchmarks/slow_rank.py in its short form: two jobs of two ranks (report, rebalance; the benchmark's
baseline, no slow-rank handling, is its own and not asserted here), the last rank
held to 20 % of a CPU from outside its process (a cgroup CPU quota where this process may make one,
else stopped 80 % of the time by SIGSTOP/SIGCONT; the output says which), each job ended by SIGTERM once
what it waits for is in its event log, so nothing here waits on a clock: the runtime names the
throttled rank, rebalancing gives it the smaller share, and the sample audit finds every sample of
every job trained exactly once. The throughput figures are the benchmark's (docs/results.md), not
asserted; the table is checked on recorded rows in tests/unit/test_slow_rank_table.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import warm
from support import REPO, worker_env

pytestmark = pytest.mark.slow


def test_the_throttled_rank_is_named_rebalanced_and_every_sample_trained_once(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    result = warm.run(
        [sys.executable, "benchmarks/slow_rank.py", "--ranks", "2", "--modes", "report,rebalance",
         "--stopped", "0.8", "--stop-when-named", "--steps", "3000", "--throttle-after", "10", "--settle", "10",
         "--json", str(out), "--workdir", str(tmp_path / "jobs")],
        timeout=600, cwd=REPO, env=worker_env(),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    written = json.loads(out.read_text())
    assert written["benchmark"] == "slow_rank" and written["provenance"]["commit"] is not None
    rows = {row["mode"]: row for row in written["results"]["rows"]}
    assert set(rows) == {"report", "rebalance"}
    for mode, row in rows.items():
        assert row["exactly_once"] is True and row["steps"] > 0, (mode, row)
    for mode in ("report", "rebalance"):
        assert rows[mode]["named_rank"] == 1 and rows[mode]["seconds_to_named"] is not None, rows[mode]
    assert rows["report"]["rebalanced"] is None  # report changes nobody's samples
    fast, slow = rows["rebalance"]["rebalanced"]
    assert fast + slow == 2 * 64 and slow < fast, rows["rebalance"]
    events = [json.loads(line) for line in (tmp_path / "jobs" / "w2-report" / "events.jsonl").read_text().splitlines()]
    named = [e for e in events if e["event"] == "straggler"]
    first = next(e for e in named if e["rank"] == 1)  # (a busy machine may name rank 0 for a while too: a false alarm)
    assert first["slowdown"] >= 1.25 and first["host"] and first["node"], named
    assert len([e for e in named if e["rank"] == 1]) == 1, named  # once per episode, not at every vote
    assert "ranks mode" in result.stdout and "exactly-once" in result.stdout
    assert "throttle: a cgroup v" in result.stdout or "throttle: a SIGSTOP/SIGCONT duty cycle" in result.stdout
