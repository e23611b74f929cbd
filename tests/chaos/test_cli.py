"""`python -m elastic.chaos`, as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO, worker_env

pytestmark = pytest.mark.slow


def test_runs_a_scenario_on_an_etcd_of_its_own_and_prints_its_verdict(tmp_path: Path, tiny_corpus: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "elastic.chaos", "--scenario", "etcd-restart", "--backend", "etcd-v3",
         "--data", str(tiny_corpus), "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=worker_env(),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.startswith("etcd-restart: ok; exit codes [0, 0]")
    assert "samples: each once (steps 1-40" in done.stdout
    assert "all 1 scenarios passed" in done.stdout
    assert (tmp_path / "etcd-restart" / "agent0.log").exists()
    assert not [p for p in Path("/proc").iterdir() if p.name.isdigit() and _is_etcd_of(p, tmp_path)], "etcd left running"


def _is_etcd_of(proc: Path, workdir: Path) -> bool:
    try:
        return str(workdir) in (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--scenario", "etcd-restart", "--backend", "etcd-v3", "--endpoint", "127.0.0.1:2379"], {},
         "--scenario etcd-restart restarts etcd: it needs --backend etcd-v3 without --endpoint"),
        (["--scenario", "hang", "--endpoint", "127.0.0.1:2379"], {}, "--endpoint is etcd's address"),
        (["--scenario", "hang", "--backend", "etcd-v3"], {"PATH": "/nonexistent"}, "etcd is not installed"),
    ],
)
def test_impossible_requests_are_one_line_exit_2(tmp_path: Path, args: list[str], env: dict, message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "elastic.chaos", *args, "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=worker_env(**env))
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
