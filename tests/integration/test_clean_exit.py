"""Clean exits under load: the shortest real job (GPT recipe, tiny, 2 workers, gloo on CPU)
never ends its workers with SIGABRT ("terminate called without an active exception", exit -6).

10 runs, two at a time beside a CPU burner, keep the suite's time; ELASTIC_EXIT_STRESS_RUNS=50
(or `python benchmarks/exit_stress.py`) runs more.
"""

from __future__ import annotations

import os
import sys

import pytest
from support import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import exit_stress  # noqa: E402

RUNS = int(os.environ.get("ELASTIC_EXIT_STRESS_RUNS", "10"))


@pytest.mark.slow
@pytest.mark.timeout(60 * max(10, RUNS))
def test_the_shortest_job_never_aborts_at_exit_under_load() -> None:
    outcomes = exit_stress.stress(runs=RUNS, parallel=2, burners=1, steps=4, timeout=300)
    aborted = [o for o in outcomes if o.aborted]
    failed = [o for o in outcomes if not o.ok and not o.aborted]
    assert not aborted, f"{len(aborted)} of {RUNS} runs aborted at exit:\n{aborted[0].tail}"
    assert not failed, f"{len(failed)} of {RUNS} runs failed:\n{failed[0].tail}"
