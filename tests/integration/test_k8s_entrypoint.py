"""The image's entrypoint: PID 1 of a trainer pod passes SIGTERM on, keeps the job's status, idles after success."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kube import K8S

ENTRYPOINT = K8S / "entrypoint.sh"
# As in a pod, the shell is PID 1 of its own PID namespace (root only); elsewhere a plain child.
AS_PID_1 = os.geteuid() == 0 and shutil.which("unshare") is not None

JOB = """
import signal, sys, time, pathlib
mark = pathlib.Path(sys.argv[1])
def stop(signum, frame):
    mark.write_text("terminated")
    sys.exit(7)
signal.signal(signal.SIGTERM, stop)
mark.with_suffix(".ready").write_text("ready")
time.sleep(60)
"""


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _kill_what_a_test_left() -> Iterator[None]:
    """A failing test must not leave an idling entrypoint behind."""
    yield
    while STARTED:
        process = STARTED.pop()
        if process.poll() is None:
            process.kill()
            process.wait(5)


def start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    prefix = ["unshare", "--pid", "--fork", "--kill-child"] if AS_PID_1 else []
    # With unshare --kill-child, killing unshare ends the namespace and the job in it.
    process = subprocess.Popen([*prefix, "sh", str(ENTRYPOINT), *args], env={**os.environ, **(env or {})},
                               stderr=subprocess.PIPE, text=True)
    STARTED.append(process)
    return process


def entrypoint_pid(process: subprocess.Popen) -> int:
    """The shell running the entrypoint (unshare's child when it is PID 1 of a namespace)."""
    if not AS_PID_1:
        return process.pid
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.02)
    raise AssertionError("the entrypoint shell did not start")


def wait_for_file(path: Path) -> None:
    deadline = time.monotonic() + 20
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_sigterm_reaches_the_job_and_its_status_is_the_pods(tmp_path: Path) -> None:
    mark = tmp_path / "mark"
    process = start([sys.executable, "-c", JOB, str(mark)], {"IDLE_AFTER_SUCCESS": "1"})
    wait_for_file(mark.with_suffix(".ready"))
    os.kill(entrypoint_pid(process), signal.SIGTERM)  # what the kubelet does on `kubectl delete pod`
    assert process.wait(20) == 7, process.stderr.read()
    assert mark.read_text() == "terminated", "the job never saw the SIGTERM"


def test_a_finished_job_leaves_the_pod_idle_until_it_is_deleted(tmp_path: Path) -> None:
    process = start([sys.executable, "-c", "print('trained')"], {"IDLE_AFTER_SUCCESS": "1"})
    shell = entrypoint_pid(process)
    deadline = time.monotonic() + 20
    while True:  # wait for the idle message, then check it stays up
        line = process.stderr.readline()
        if "the job finished; idling" in line:
            break
        assert line and time.monotonic() < deadline, "the entrypoint did not report the finished job"
    time.sleep(0.3)
    assert process.poll() is None, "a finished job's pod must not exit (the StatefulSet would restart it)"
    os.kill(shell, signal.SIGTERM)
    assert process.wait(20) == 0


@pytest.mark.parametrize("idle", ["1", "0"])
def test_a_failed_job_exits_with_its_status(idle: str) -> None:
    process = start([sys.executable, "-c", "raise SystemExit(3)"], {"IDLE_AFTER_SUCCESS": idle})
    assert process.wait(20) == 3


def test_without_idle_a_finished_job_exits_0() -> None:
    assert start([sys.executable, "-c", "pass"]).wait(20) == 0
