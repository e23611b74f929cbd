"""deploy/slurm/common.sh, the part every batch script shares, run by bash with stand-ins for srun
and scancel: srun's exit status comes back through a requeue signal passed on; the other warning
signal does not end the shell; a misnamed signal or a snapshot secret that is not private stops
the script with one line, exit 2."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from support import REPO, wait_for

SCRIPT = 'source "$1/deploy/slurm/common.sh"; run_step -n1 python recipes/gpt.py; echo "status=$?"'


@pytest.fixture
def shell_env(tmp_path: Path) -> dict[str, str]:
    if shutil.which("bash") is None:
        pytest.skip("no bash here: the batch scripts are bash scripts")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # srun says it started, then runs until the test lets it end (or 30 s), and exits 7 (or SRUN_STATUS)
    (bin_dir / "srun").write_text(f"#!/bin/sh\ntouch {tmp_path / 'started'}\n"
                                  f"for i in $(seq 600); do [ -e {tmp_path / 'go'} ] && exit ${{SRUN_STATUS:-7}}; "
                                  "sleep 0.05; done\nexit ${SRUN_STATUS:-7}\n")
    (bin_dir / "scancel").write_text(f"#!/bin/sh\necho \"$*\" >> {tmp_path / 'scancel.log'}\n")
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$*\" >> {tmp_path / 'scontrol.log'}\n")
    for tool in ("srun", "scancel", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(REPO),
            "SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n1", "CKPT_DIR": str(tmp_path / "ckpt")}


def in_wait(pid: int) -> bool:
    """Whether the shell `pid` blocks in `wait` (run_step's; where the kernel does not say, any time will do)."""
    try:
        channel = Path(f"/proc/{pid}/wchan").read_text().strip()
    except OSError:
        return True
    return channel in ("do_wait", "0", "")


def test_the_requeue_signal_is_passed_on_and_sruns_status_comes_back(shell_env: dict[str, str], tmp_path: Path) -> None:
    proc = subprocess.Popen(["bash", "-c", SCRIPT, "bash", str(REPO)], env=shell_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (tmp_path / "started").exists() and in_wait(proc.pid), 30, "run_step waiting for srun")
        proc.send_signal(signal.SIGUSR1)
        proc.send_signal(signal.SIGUSR2)  # not the requeue signal: ignored, not fatal
        wait_for(lambda: (tmp_path / "scancel.log").exists(), 30, "the trap passing the signal on")
        (tmp_path / "go").touch()  # srun ends after the signal
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "status=7" in out, (out, err)
    assert (tmp_path / "scancel.log").read_text().split("\n")[0] == "--signal=USR1 5"
    secret = tmp_path / "ckpt" / ".snapshot-secret"
    text = secret.read_text()
    assert len(text) == 64 and int(text, 16) >= 0 and (secret.stat().st_mode & 0o777) == 0o600  # 32 bytes as hex
    assert f"TORCHREVIVE_SNAPSHOT_SECRET_FILE={secret}" not in out + err  # named only in the environment
    assert not (tmp_path / "scontrol.log").exists(), "a status that is not final leaves the requeue alone"


def test_a_crash_loop_status_is_final_the_job_is_not_requeued(shell_env: dict[str, str], tmp_path: Path) -> None:
    from elastic._agent.launcher.failure_policy import CRASH_LOOP_EXIT

    (tmp_path / "go").touch()  # srun ends at once, with the crash loop's status
    done = subprocess.run(["bash", "-c", SCRIPT, "bash", str(REPO)], capture_output=True, text=True, timeout=30,
                          env={**shell_env, "SRUN_STATUS": str(CRASH_LOOP_EXIT)}, check=False)
    assert f"status={CRASH_LOOP_EXIT}" in done.stdout, (done.stdout, done.stderr)
    assert (tmp_path / "scontrol.log").read_text().split("\n")[0] == "update JobId=5 Requeue=0"
    assert f"final exit status {CRASH_LOOP_EXIT}" in done.stderr and "not requeued" in done.stderr


def test_a_misnamed_signal_or_a_shared_secret_stops_the_script(shell_env: dict[str, str], tmp_path: Path) -> None:
    bad = subprocess.run(["bash", "-c", SCRIPT, "bash", str(REPO)], capture_output=True, text=True, timeout=30,
                         env={**shell_env, "TORCHREVIVE_REQUEUE_SIGNAL": "TERM"})
    assert bad.returncode == 2 and "TORCHREVIVE_REQUEUE_SIGNAL=TERM is not USR1, USR2 or none" in bad.stderr
    secret = tmp_path / "ckpt" / ".snapshot-secret"
    secret.parent.mkdir()
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o644)
    shared = subprocess.run(["bash", "-c", SCRIPT, "bash", str(REPO)], env=shell_env, capture_output=True, text=True,
                            timeout=30)
    assert shared.returncode == 2 and "must be a non-empty file of yours with mode 600" in shared.stderr
    assert "status=" not in shared.stdout  # no step started
