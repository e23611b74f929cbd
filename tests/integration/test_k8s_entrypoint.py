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


def readiness(mark: Path) -> int:
    """The trainer manifest's readiness probe, run as the kubelet would in the container: 0 is ready."""
    from kube import build, find, pod_spec

    probe = pod_spec(find(build(K8S), "StatefulSet", "trainer"))["containers"][0]["readinessProbe"]["exec"]["command"]
    return subprocess.run(probe, env={**os.environ, "STOPPED_MARK": str(mark)}, timeout=20).returncode


@pytest.mark.parametrize(("status", "why"), [(2, "bad input"), (75, "checkpoint storage refuses writes")])
def test_a_final_exit_idles_the_pod_not_ready_and_says_why_in_one_line(tmp_path: Path, status: int, why: str) -> None:
    mark = tmp_path / "stopped"
    mark.write_text("left by the container before this one's restart")
    env = {"IDLE_AFTER_SUCCESS": "1", "FINAL_EXIT_CODES": "2 75", "STOPPED_MARK": str(mark)}
    ready_file = tmp_path / "ran"
    job = f"import pathlib, sys; pathlib.Path({str(ready_file)!r}).write_text('x'); sys.exit({status})"
    process = start([sys.executable, "-c", job], env)
    shell = entrypoint_pid(process)
    wait_for_file(ready_file)
    line = process.stderr.readline()
    assert line.startswith(f"entrypoint: the job stopped with exit status {status}, {why}") and "a restart would stop" in line
    assert line.rstrip().endswith("kubectl rollout restart statefulset/trainer")
    wait_for_file(mark)
    assert mark.read_text() == line, "the stale mark was removed at start; the new one says why"
    assert readiness(mark) != 0, "a stopped pod is not ready"
    time.sleep(0.3)
    assert process.poll() is None, "a stopped pod idles: a restart would stop again at the same check"
    os.kill(shell, signal.SIGTERM)
    assert process.wait(20) == 0


def test_other_failures_still_exit_so_the_pod_restarts(tmp_path: Path) -> None:
    mark = tmp_path / "stopped"
    env = {"FINAL_EXIT_CODES": "2 75", "STOPPED_MARK": str(mark)}
    assert start([sys.executable, "-c", "raise SystemExit(1)"], env).wait(20) == 1
    assert not mark.exists() and readiness(mark) == 0
