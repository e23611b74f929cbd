"""The agent-side reaper ends stopped workers that were told to terminate, and nothing else."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

from elastic._agent.launcher.proctree import descendants, worker_rank
from elastic._agent.launcher.reaper import Reaper, stopped_with_sigterm_pending

# What the reaper reads of a worker (its state, pending signals, RANK) is the same for any program:
# coreutils' sleep stands in for a Python worker without an interpreter's start.
SLEEP = [shutil.which("sleep") or "/bin/sleep", "60"]


def start(rank: int | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    if rank is not None:
        env["RANK"] = str(rank)  # what torchrun gives a worker
    return subprocess.Popen(SLEEP, env=env)


def wait_state(pid: int, letter: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] == letter:
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} never reached state {letter}")


def stop_then_term(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGSTOP)
    wait_state(process.pid, "T")
    process.send_signal(signal.SIGTERM)  # what torchrun's agent sends when it stops the group
    time.sleep(0.05)


def test_a_stopped_worker_with_sigterm_pending_is_killed_on_the_second_look() -> None:
    worker, bystander, running = start(rank=1), start(rank=None), start(rank=0)
    try:
        worker.send_signal(signal.SIGSTOP)
        wait_state(worker.pid, "T")
        reaper = Reaper(os.getpid())
        assert not stopped_with_sigterm_pending(worker.pid)
        assert reaper.scan() == [] and reaper.scan() == [], "a stopped worker nobody asked to stop is left alone"
        stop_then_term(worker)
        stop_then_term(bystander)
        assert stopped_with_sigterm_pending(worker.pid) and worker_rank(worker.pid) == 1
        assert reaper.scan() == [], "one look is not enough"
        assert reaper.scan() == [worker.pid]
        assert worker.wait(5) == -signal.SIGKILL
        assert bystander.poll() is None, "a process that is not a torchrun worker is never touched"
        assert running.poll() is None, "a running worker is never touched"
    finally:
        for p in (worker, bystander, running):
            p.kill()
            p.wait()


def test_a_sigterm_followed_by_sigcont_reaches_the_worker() -> None:
    """`kill -TERM` then `kill -CONT` of a stopped job: the worker's own handler runs."""
    worker = start(rank=0)
    try:
        reaper = Reaper(os.getpid())
        stop_then_term(worker)
        assert reaper.scan() == []
        worker.send_signal(signal.SIGCONT)
        assert worker.wait(5) == -signal.SIGTERM, "it died of its SIGTERM, not of the reaper"
        assert reaper.scan() == []
    finally:
        worker.kill()
        worker.wait()


def test_descendants_include_grandchildren_parents_first() -> None:
    parent = subprocess.Popen(["sh", "-c", f"{SLEEP[0]} 60 & exec {SLEEP[0]} 60"])  # one child of its own
    try:
        deadline = time.monotonic() + 10
        while len(descendants(parent.pid)) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        (grandchild,) = descendants(parent.pid)
        mine = descendants(os.getpid())
        assert mine.index(parent.pid) < mine.index(grandchild)
    finally:
        for pid in descendants(parent.pid):
            os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait()
