"""The unit tier is one process with no servers, and this makes it so.

Every unit test runs with the ways to start a process (subprocess, fork,
spawn) and to serve (a listening socket, a TCPStore server) turned into an
error that names the tier to move the test to: tests/integration for anything
that starts etcd, a keeper, a store or a job, tests/chaos for faults on jobs.
"""

from __future__ import annotations

import multiprocessing.util
import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed as dist


def _refuse(what: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(
            f"a unit test {what}: tests/unit is one process with no servers; move the test to tests/integration"
        )

    return refuse


SERVER_FIXTURES = {"shared_etcd", "etcd", "network", "keeper", "references", "s3_server"}
"""Fixtures that start a server or hosts (tests/conftest.py): a unit test may not ask for them."""


@pytest.fixture(scope="session", autouse=True)
def fonts_found_before_the_guard() -> None:
    """matplotlib asks `fc-list` for the system's fonts the first time it draws on a machine (no font
    cache yet): a fresh CI machine would otherwise start that process inside a drawing test."""
    try:
        import matplotlib.font_manager  # noqa: F401 - building its cache is the point
    except ImportError:
        pass


@pytest.fixture(autouse=True)
def one_process_no_servers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    servers = SERVER_FIXTURES.intersection(request.fixturenames)
    if servers:
        _refuse(f"uses {', '.join(sorted(servers))}")()
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("starts a process"))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refuse("forks or spawns a process"))
    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", _refuse("spawns a process"))
    monkeypatch.setattr(socket.socket, "listen", _refuse("listens on a socket (a server)"))
    store = dist.TCPStore

    def tcp_store(*args: Any, **kwargs: Any) -> dist.TCPStore:
        if kwargs.get("is_master") or (len(args) > 2 and args[2]):
            _refuse("serves a TCPStore")()
        return store(*args, **kwargs)

    monkeypatch.setattr(dist, "TCPStore", tcp_store)
    yield


def _environment() -> dict[str, str]:
    """os.environ less what pytest and torch set for themselves: PYTEST_CURRENT_TEST (each phase), and the
    inductor cache directory torch names once per process at its first use (whichever test that is)."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST" and not k.startswith("TORCHINDUCTOR_")}


@pytest.fixture(autouse=True)
def environment_left_as_found() -> Iterator[None]:
    """The unit tier is one process: a variable a test leaves in os.environ reaches every later test
    (RANK and WORLD_SIZE left by a fixture once made test_run's plain Run a distributed one). Set them with
    monkeypatch.setenv; a test that leaves one fails here, and the environment is put back."""
    before = _environment()
    yield
    after = _environment()
    if after != before:
        for name in after.keys() - before.keys():
            del os.environ[name]
        os.environ.update(before)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        pytest.fail(f"the test left os.environ changed: {changed} (use monkeypatch.setenv)")
