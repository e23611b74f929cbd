"""torchrevive-run as a process: torchrun's flags, no CUDA touched by the default preload, and the keeper
told whenever the agent stops its workers."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support import REPO

from elastic.launcher.warm_start import DEFAULT_PRELOAD


def test_takes_torchrun_flags_and_rejects_what_torchrun_rejects() -> None:
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "elastic.launcher", "--help"], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0
    for flag in ("--nnodes", "--rdzv-backend", "--rdzv-conf", "--max-restarts", "--monitor-interval", "--standalone"):
        assert flag in done.stdout
    # Every agent start pays its imports (a node that joins, every test's job): torch.distributed.checkpoint
    # (with DTensor and sympy, about 1 s of CPU) is the workers' and a breakpoint commit's, not the agent's.
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "torch.distributed.run" in imported and "torch.distributed.checkpoint" not in imported, "the agent imports DCP"
    bad = subprocess.run([sys.executable, "-m", "elastic.launcher", "--nnodes=x:y", "script.py"], capture_output=True,
                         text=True, timeout=60, cwd=REPO)
    assert bad.returncode != 0


CUDA_SPY = """
import sys, torch
calls = []
def spy(name, original):
    def wrapper(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)
    return wrapper
for name in ("_cuda_getDeviceCount", "_cuda_init"):
    if hasattr(torch._C, name):
        setattr(torch._C, name, spy(name, getattr(torch._C, name)))
for name in ("is_available", "device_count", "_lazy_init", "init"):
    setattr(torch.cuda, name, spy(name, getattr(torch.cuda, name)))
for module in sys.argv[1:]:
    __import__(module)
print(calls)
"""


def test_the_default_preload_never_touches_cuda() -> None:
    """A fork server that initialised CUDA would hand every worker a broken CUDA."""
    done = subprocess.run([sys.executable, "-c", CUDA_SPY, *DEFAULT_PRELOAD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_keeper_is_told_whenever_the_agent_stops_its_workers(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from torch.distributed.elastic.agent.server.local_elastic_agent import (
        LocalElasticAgent,
    )

    from elastic.launcher import launch
    from elastic.storage.keeper_address import KeeperAddress
    from elastic.storage.peer_auth import SECRET_ENV

    monkeypatch.setenv("TORCHREVIVE_SNAPSHOT_BASE", str(tmp_path))
    monkeypatch.setattr(LocalElasticAgent, "_stop_workers", lambda self, group: "stopped")
    for key in [*KeeperAddress(tmp_path, "", "", tmp_path / "secret").environ(), SECRET_ENV]:
        monkeypatch.setenv(key, "")  # so that what start_keeper sets is undone after the test
    keeper = launch.start_keeper(argparse.Namespace(local_addr="127.0.0.1"))
    try:
        assert KeeperAddress.from_env() == keeper.address  # what the workers inherit
        assert keeper.url.startswith("http://127.0.0.1:")
        told = []
        monkeypatch.setattr(keeper, "workers_stopped", lambda: told.append(True))
        assert LocalElasticAgent._stop_workers(object(), None) == "stopped" and told == [True]
        launch.notify_on_stop(keeper)  # again (a second launch in one process): still told once per stop
        LocalElasticAgent._stop_workers(object(), None)
        assert told == [True, True]
    finally:
        keeper.close(timeout=10)
    assert not keeper.root.exists()
    monkeypatch.setenv("TORCHREVIVE_SNAPSHOTS", "0")
    assert launch.start_keeper(argparse.Namespace(local_addr="127.0.0.1")) is None


def test_a_worker_that_exits_on_bad_input_is_not_restarted() -> None:
    """Exit 2 (a bad flag) would come back on every restart: the agent ends the job at once, with
    one line and the worker's status."""
    from support import worker_env

    done = subprocess.run(
        [sys.executable, "-m", "elastic.launcher", "--standalone", "--nproc-per-node=1", "--max-restarts=3",
         "recipes/gpt.py", "--max-steps", "-3"],
        cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "gpt.py: error: argument --max-steps" in done.stderr
    assert "not restarted, since a restart would meet the same input" in done.stderr, done.stderr[-3000:]
    assert done.stderr.count("gpt.py: error: argument --max-steps") == 1, "the worker was restarted"
