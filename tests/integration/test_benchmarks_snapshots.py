"""The in-memory snapshot benchmark runs end to end once, --quick (tiny sizes; its figures are not asserted).

Its table, lines and refusal are checked on recorded figures in tests/unit/test_benchmark_tables.py."""

from __future__ import annotations

import re
import sys

import pytest
import warm
from support import REPO, worker_env

pytestmark = pytest.mark.slow

NUMBER = r"(\d+\.\d+)"


def test_snapshot_restore_benchmark_prints_a_memory_and_a_disk_restore() -> None:
    result = warm.run(
        [sys.executable, "benchmarks/snapshot_restore.py", "--quick"],
        timeout=240, cwd=REPO, env=worker_env(),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = re.search(
        rf"^tiny: restore from memory {NUMBER} s, from disk {NUMBER} s \(page cache\), {NUMBER} s \(cold\); "
        rf"disk/memory {NUMBER}x, cold/memory {NUMBER}x$",
        result.stdout, re.M,
    )
    assert line, result.stdout
    memory, disk, cold = (float(x) for x in line.groups()[:3])
    assert memory > 0 and disk > 0 and cold > 0, result.stdout
    row = re.search(rf"^tiny +[\d.]+M +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER} .* (ok|MISMATCH)$", result.stdout, re.M)
    assert row and row.group(5) == "ok", f"the restored state is not the trained one\n{result.stdout}"
    blocking = re.search(r"^tiny: snapshot blocking [\d.]+ ms .*: [\d.]+ \(target <= 0\.02: (met|MISSED)\)", result.stdout, re.M)
    assert blocking, result.stdout
    assert "100m" not in result.stdout, "--quick measures the tiny model only"
