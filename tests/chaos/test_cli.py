"""`python -m elastic.chaos`, as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO, worker_env

pytestmark = pytest.mark.slow


def test_runs_a_scenario_and_prints_its_verdict(tmp_path: Path, tiny_corpus: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "elastic.chaos", "--scenario", "kill-worker", "--data", str(tiny_corpus),
         "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=worker_env(),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.startswith("kill-worker: ok; exit codes [0, 0]")
    assert "all 1 scenarios passed" in done.stdout
    assert (tmp_path / "kill-worker" / "agent0.log").exists()


def test_etcd_backend_without_endpoint_is_one_line_exit_2() -> None:
    done = subprocess.run([sys.executable, "-m", "elastic.chaos", "--scenario", "hang", "--backend", "etcd-v3"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "--endpoint" in done.stderr
