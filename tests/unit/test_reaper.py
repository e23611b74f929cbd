"""The agent-side reaper ends stopped workers that were told to terminate, and nothing else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from elastic.proctree import descendants
from elastic.reaper import reap_once, stopped_with_sigterm_pending


def wait_state(pid: int, letter: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] == letter:
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} never reached state {letter}")


def test_a_stopped_child_is_killed_only_once_sigterm_is_pending() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        child.send_signal(signal.SIGSTOP)
        wait_state(child.pid, "T")
        assert not stopped_with_sigterm_pending(child.pid)
        assert reap_once(os.getpid()) == [], "a stopped worker nobody asked to stop is left alone"
        child.send_signal(signal.SIGTERM)  # what torchrun's agent sends when it stops the group
        time.sleep(0.05)
        assert stopped_with_sigterm_pending(child.pid)
        assert reap_once(os.getpid()) == [child.pid]
        assert child.wait(5) == -signal.SIGKILL
        assert running.poll() is None, "a running process is never touched"
    finally:
        for p in (child, running):
            p.kill()
            p.wait()


def test_descendants_include_grandchildren() -> None:
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"])
    try:
        deadline = time.monotonic() + 10
        while len(descendants(parent.pid)) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        (grandchild,) = descendants(parent.pid)
        assert parent.pid in descendants(os.getpid()) and grandchild in descendants(os.getpid())
    finally:
        for pid in descendants(parent.pid):
            os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait()
