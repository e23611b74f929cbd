"""The launcher is torchrun with recovery defaults: it only fills in what the user left out."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support import REPO

from elastic.errors import UsageError
from elastic.launcher.warm_start import DEFAULT_PRELOAD, PRELOAD_ENV, preload_modules
from elastic.recovery_defaults import RECOVERY_RDZV_CONF, merged_rdzv_conf


def test_defaults_fill_an_empty_conf() -> None:
    assert dict(item.split("=") for item in merged_rdzv_conf("").split(",")) == RECOVERY_RDZV_CONF


def test_user_values_win_and_other_keys_pass_through() -> None:
    merged = merged_rdzv_conf("last_call_timeout=9,join_timeout=120,read_timeout=5")
    pairs = dict(item.split("=") for item in merged.split(","))
    assert pairs["last_call_timeout"] == "9"
    assert pairs["join_timeout"] == "120" and pairs["read_timeout"] == "5"
    assert pairs["keep_alive_interval"] == RECOVERY_RDZV_CONF["keep_alive_interval"]
    assert merged.startswith("last_call_timeout=9,join_timeout=120,read_timeout=5")


def test_takes_torchrun_flags_and_rejects_what_torchrun_rejects() -> None:
    done = subprocess.run([sys.executable, "-m", "elastic.launcher", "--help"], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert done.returncode == 0
    for flag in ("--nnodes", "--rdzv-backend", "--rdzv-conf", "--max-restarts", "--monitor-interval", "--standalone"):
        assert flag in done.stdout
    bad = subprocess.run([sys.executable, "-m", "elastic.launcher", "--nnodes=x:y", "script.py"], capture_output=True,
                         text=True, timeout=60, cwd=REPO)
    assert bad.returncode != 0


def test_preload_defaults_to_torch_and_an_empty_value_turns_warm_starts_off() -> None:
    assert preload_modules({}) == DEFAULT_PRELOAD
    assert preload_modules({PRELOAD_ENV: ""}) == ()
    assert preload_modules({PRELOAD_ENV: " json , torch "}) == ("json", "torch")


def test_preload_of_a_module_that_does_not_exist_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="'no_such_module_xyz'"):
        preload_modules({PRELOAD_ENV: "torch,no_such_module_xyz"})
    with pytest.raises(UsageError, match="'no_such_package_xyz.sub'"):
        preload_modules({PRELOAD_ENV: "no_such_package_xyz.sub"})


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

    monkeypatch.setenv("TORCHREVIVE_SNAPSHOT_BASE", str(tmp_path))
    monkeypatch.setattr(LocalElasticAgent, "_stop_workers", lambda self, group: "stopped")
    for key in KeeperAddress(tmp_path, "", "").environ():
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
