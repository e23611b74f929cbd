"""A worker that stops making progress (SIGSTOP, deadlock) is detected and the job goes on."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from support import REPO, TINY_MODEL, standalone_command, worker_env

from elastic.events import read_events
from elastic.watchdog import EXIT_CODE

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("action", ["stop", "hang"])
def test_stopped_or_deadlocked_worker_trips_the_watchdog_and_the_job_completes(
    tmp_path: Path, tiny_corpus: Path, action: str
) -> None:
    events = tmp_path / "events.jsonl"
    args = [
        "--data", str(tiny_corpus), "--max-steps", "30", "--eval-every", "0", "--events", str(events),
        "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "5", "--hang-timeout", "3",
        "--collective-timeout", "600",  # far away: only the watchdog can end the hang
        *TINY_MODEL,
    ]
    done = subprocess.run(
        standalone_command(2, args, max_restarts=1), capture_output=True, text=True, timeout=240, cwd=REPO,
        env=worker_env(ELASTIC_FAULT=f"after_step@12:rank=1:do={action}"),
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "watchdog: no training step completed" in output
    assert f"exitcode  : {EXIT_CODE}" in output or f"exit code {EXIT_CODE}" in output or str(EXIT_CODE) in output
    recorded = list(read_events(events))
    restores = [e for e in recorded if e["event"] == "restore"]
    assert restores and restores[-1]["step"] == 10, "resumed from the checkpoint before the hang"
    assert [e["step"] for e in recorded if e["event"] == "end"] == [30]
