"""The benchmarks run end to end (tiny sizes; their figures are not asserted: timings live in the README)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from support import REPO, worker_env

pytestmark = pytest.mark.slow


def test_overhead_benchmark_prints_both_loops_and_their_ratio() -> None:
    result = subprocess.run(
        [sys.executable, "benchmarks/overhead.py", "--steps", "6", "--warmup", "2", "--rounds", "1", "--batch-size", "4"],
        capture_output=True, text=True, timeout=240, cwd=REPO, env=worker_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"recipe/gpt.py [\d.]+ steps/s \| seed-style DDP [\d.]+ steps/s \| ratio [\d.]+", result.stdout)
