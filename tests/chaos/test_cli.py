"""`python -m elastic.chaos`, as a user runs it: its refusals (a whole run through it is
tests/chaos/test_scenarios.py::test_etcd_v3_restart_of_etcd_mid_recovery_through_the_cli)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import warm
from support import REPO, worker_env

pytestmark = pytest.mark.slow


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
    done = warm.run([sys.executable, "-m", "elastic.chaos", *args, "--workdir", str(tmp_path)], timeout=60, cwd=REPO,
                    env=worker_env(**env))
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
