"""torchrevive-run as a process: torchrun's flags, no CUDA touched by the default preload, and the keeper
told whenever the agent stops its workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support import REPO, worker_env

from elastic._agent.launcher.warm_start import DEFAULT_PRELOAD

# Runs `python -m elastic._agent.launcher ARGS` once per case in this one interpreter (a torch import each
# would cost more than all of them), each case with its own working directory, variables, and stdout
# and stderr (file descriptors 1 and 2: what C code writes too). The first case runs in a fresh
# interpreter, so anything an import prints shows in its output.
COMMAND_LINES = r"""
import json, os, runpy, sys, tempfile
results = []
for case in json.loads(sys.argv[1]):
    os.chdir(case["cwd"])
    before = {name: os.environ.get(name) for name in case["env"]}
    os.environ.update(case["env"])
    sys.argv = ["torchrevive-run", *case["args"]]
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            runpy.run_module("elastic._agent.launcher", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
        out.seek(0)
        err.seek(0)
        results.append({"returncode": code, "stdout": out.read(), "stderr": err.read()})
    for name, value in before.items():
        if value is None:
            del os.environ[name]
        else:
            os.environ[name] = value
print(json.dumps(results))
"""


def test_command_lines_torchrun_takes_or_rejects_and_those_that_fail_at_once_in_one_line(tmp_path) -> None:
    """torchrun's flags; what torchrun rejects; and a missing script, a preload module that cannot be
    imported and a password in --rdzv-conf, each one line and exit 2 before any agent starts (before
    torch's agent logs its options: the password reaches no log)."""
    (tmp_path / "probe.py").write_text("")
    one_line_exit_2 = [
        (["no/such/script.py"], {}, "training script no/such/script.py does not exist"),
        (["probe.py"], {"TORCHREVIVE_PRELOAD": "torch,no_such_module_xyz"}, "'no_such_module_xyz'"),
        (["--rdzv-conf=user=root,password=hunter2secret", "probe.py"], {}, "give password_file=PATH instead"),
    ]
    cases = [
        {"args": ["--help"], "env": {}, "cwd": str(REPO)},
        {"args": ["--nnodes=x:y", "script.py"], "env": {}, "cwd": str(REPO)},
        *({"args": ["--standalone", "--nproc-per-node=1", *args], "env": env, "cwd": str(tmp_path)}
          for args, env, _ in one_line_exit_2),
    ]
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", COMMAND_LINES, json.dumps(cases)],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=worker_env(PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stderr[-3000:]
    # Nothing but this script's own imports outside the cases, at the exit too (a library thread left behind).
    assert [line for line in done.stderr.splitlines() if not line.startswith("import time:")] == [], done.stderr[-3000:]
    (usage, bad_nnodes, *failing) = json.loads(done.stdout)

    assert usage["returncode"] == 0
    for flag in ("--nnodes", "--rdzv-backend", "--rdzv-conf", "--max-restarts", "--monitor-interval", "--standalone"):
        assert flag in usage["stdout"]
    # Every agent start pays its imports (a node that joins, every test's job): torch.distributed.checkpoint
    # (with DTensor and sympy, about 1 s of CPU) is the workers' and a breakpoint commit's, not the agent's.
    usage_lines = usage["stderr"].splitlines()
    imported = {line.rsplit("|", 1)[-1].strip() for line in usage_lines if line.startswith("import time:")}
    assert "torch.distributed.run" in imported and "torch.distributed.checkpoint" not in imported, "the agent imports DCP"
    assert [line for line in usage_lines if not line.startswith("import time:")] == [], "an import printed something"

    assert bad_nnodes["returncode"] != 0

    for (args, _, message), result in zip(one_line_exit_2, failing, strict=True):
        lines = [line for line in result["stderr"].splitlines() if not line.startswith("import time:")]
        assert result["returncode"] == 2, (args, result)
        assert len(lines) == 1, (args, lines)
        assert message in lines[0] and "hunter2secret" not in result["stderr"] + result["stdout"], (args, result)


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

    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import (
        LocalElasticAgent,
    )
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    from elastic._agent.launcher import launch
    from elastic._agent.launcher.revive_agent import ReviveAgent
    from elastic._shared.storage.keeper_address import KeeperAddress
    from elastic._shared.storage.peer_auth import SECRET_ENV

    monkeypatch.setenv("TORCHREVIVE_SNAPSHOT_BASE", str(tmp_path))
    stopped: list[object] = []
    monkeypatch.setattr(LocalElasticAgent, "_stop_workers", lambda self, group: stopped.append(group))
    for key in [*KeeperAddress(tmp_path, "", "", tmp_path / "secret").environ(), SECRET_ENV]:
        monkeypatch.setenv(key, "")  # so that what start_keeper sets is undone after the test
    args = argparse.Namespace(local_addr="127.0.0.1", rdzv_endpoint="127.0.0.1:0", nnodes="1")
    keeper = launch.start_keeper(args, launch.signing_secret(args))  # a job on one host: a secret made here

    def agent() -> ReviveAgent:  # as the launcher builds it (revive_agent.launch_agent)
        spec = WorkerSpec(role="trainer", local_world_size=1, rdzv_handler=object(), entrypoint="python")
        return ReviveAgent(spec, look_every=0.1, keeper=keeper, logs_specs=DefaultLogsSpecs())

    try:
        assert KeeperAddress.from_env(os.environ) == keeper.address  # what the workers inherit
        assert keeper.url.startswith("http://127.0.0.1:")
        told = []
        monkeypatch.setattr(keeper, "workers_stopped", lambda: told.append(True))
        first = agent()
        first._stop_workers("group")
        assert stopped == ["group"] and told == [True], "torch's stop, then the keeper told"
        agent()._stop_workers("group")  # a second agent in one process: each stop tells it once
        first._stop_workers("group")
        assert told == [True, True, True] and len(stopped) == 3
    finally:
        keeper.close(timeout=10)
    assert not keeper.root.exists()
    assert not keeper.secret_file.exists()  # the secret made for the run went with its last keeper on the host
    monkeypatch.setenv("TORCHREVIVE_SNAPSHOTS", "0")
    monkeypatch.setenv("TORCHREVIVE_SNAPSHOT_SECRET_FILE", "")  # (another launch: its own secret)
    assert launch.start_keeper(args, launch.signing_secret(args)) is None


def test_a_worker_that_exits_on_bad_input_is_not_restarted() -> None:
    """Exit 2 (a bad flag) would come back on every restart: the agent ends the job at once, with
    one line and the worker's status."""
    done = subprocess.run(
        [sys.executable, "-m", "elastic._agent.launcher", "--standalone", "--nproc-per-node=1", "--max-restarts=3",
         "recipes/gpt.py", "--max-steps", "-3"],
        cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "gpt.py: error: argument --max-steps" in done.stderr
    assert "not restarted, since a restart would meet the same input" in done.stderr, done.stderr[-3000:]
    assert done.stderr.count("gpt.py: error: argument --max-steps") == 1, "the worker was restarted"
