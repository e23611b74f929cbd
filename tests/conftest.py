"""Shared fixtures: small corpora made by the tests, the shared reference runs, free ports, the recipes on sys.path."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "recipes"))

from etcd_server import EtcdServer  # noqa: E402
from references import References, session_directory  # noqa: E402
from references import shared_corpus as write_shared_corpus  # noqa: E402
from support import free_port, make_text  # noqa: E402

from elastic.chaos.netns import NetworkUnavailable, VirtualNetwork  # noqa: E402
from elastic.chaos.s3_server import S3Server  # noqa: E402


@pytest.fixture
def tiny_corpus(tmp_path: Path) -> Path:
    """About 40 KB of generated English-like text in one file."""
    path = tmp_path / "corpus.txt"
    path.write_text(make_text(random.Random(0), 40_000))
    return path


@pytest.fixture(scope="session")
def shared_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The text of the jobs that compare against a shared reference run (tests/references.py)."""
    return write_shared_corpus(session_directory(tmp_path_factory))


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory) -> References:
    """The uninterrupted reference runs, each run once per session (tests/references.py)."""
    return References(session_directory(tmp_path_factory))


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def shared_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd for the tests that only read and write keys (each under its own prefix)."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd of this test's own, for tests that stop, restart or reconfigure it."""
    server = EtcdServer(tmp_path / "etcd-data")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A local S3 server (moto) for a test file; each test uses a bucket of its own."""
    server = S3Server(log=tmp_path_factory.mktemp("s3") / "server.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def network() -> Iterator[VirtualNetwork]:
    """A virtual network for tests of separate hosts; skipped (with the reason) where
    namespaces cannot be made, e.g. without root."""
    try:
        net = VirtualNetwork.create()
    except NetworkUnavailable as exc:
        pytest.skip(f"no network namespaces here: {exc}")
    with net:
        yield net


# Hypothesis' default 200 ms deadline per example measures the machine, not the code: on a busy 2-core
# machine an example of test_regroup_env took 250 ms once and 1 ms the next time, and the suite failed.
# The suite's tests are about what the code does; speed is for the benchmarks (the project's rule).
try:
    from hypothesis import settings as _hypothesis_settings
except ImportError:  # the test extra brings it; a bare checkout still collects
    pass
else:
    _hypothesis_settings.register_profile("suite", deadline=None)
    _hypothesis_settings.load_profile("suite")


@pytest.fixture(autouse=True)
def environment_put_back() -> Iterator[None]:
    """Every tier: os.environ as it was before the test (an xdist worker runs hundreds of tests in one process,
    and in-process agents publish their round there; the unit tier also fails a test that changed it)."""
    import os

    before = dict(os.environ)
    yield
    for name in set(os.environ) - set(before):
        if name != "PYTEST_CURRENT_TEST":
            del os.environ[name]
    for name, value in before.items():
        if os.environ.get(name) != value:
            os.environ[name] = value
