"""A heal leaves no one-time work to the steps after it (issue: the first step after a failure
costs one step). Two ranks heal twice at the level the survivors do (tests/heal_steps_rank.py):
torch's fresh reducer, then the settled one; the collectives of each step are compared."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from support import free_port, worker_env

import warm

REPO = Path(__file__).resolve().parents[2]


def test_after_a_settled_heal_every_step_runs_a_steady_steps_collectives_and_nothing_else(tmp_path: Path) -> None:
    port = free_port()
    outs = [tmp_path / f"rank{rank}.json" for rank in range(2)]
    ranks = [warm.start([sys.executable, str(REPO / "tests" / "heal_steps_rank.py"), str(rank), str(port), str(out)],
                        env=worker_env(), cwd=REPO) for rank, out in enumerate(outs)]
    assert [rank.wait(timeout=240) for rank in ranks] == [0, 0]
    reports = [json.loads(out.read_text()) for out in outs]
    assert reports[0]["digest"] == reports[1]["digest"], "the ranks' parameters differ after the heals"
    for report in reports:
        seg = report["segments"]
        steady = seg["step 3"]
        # A steady step: DDP's gradient all-reduces, one per bucket (two buckets: an overlap of sorts).
        assert [name for name, _ in steady] == ["gloo:all_reduce", "gloo:all_reduce"], steady
        # torch's fresh reducer (the first heal, left as torch has it): the first step reduces the whole
        # gradient as one bucket after the backward pass, the second broadcasts a new layout first.
        assert [name for name, _ in seg["step 4"]] == ["gloo:all_reduce"], seg["step 4"]
        assert seg["step 4"][0][1] == [[sum(size[0][0] for _, size in steady)]], "one bucket of every gradient"
        assert [name for name, _ in seg["step 5"]].count("gloo:broadcast") == 2, seg["step 5"]
        # Settled at the heal: the layout is broadcast there, and the steps after it are steady ones.
        assert [name for name, _ in seg["heal 2"]].count("gloo:broadcast") == 2, seg["heal 2"]
        for after in ("step 7", "step 8", "step 9"):
            assert sorted(map(str, seg[after])) == sorted(map(str, steady)), (after, seg[after], steady)
