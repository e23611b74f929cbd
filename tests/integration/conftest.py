"""Fixtures of the integration tier: servers a test starts in its own process."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import start_keeper

from elastic._agent.launcher.keeper import SnapshotKeeper


@pytest.fixture
def node_memory(tmp_path: Path) -> Iterator[Path]:
    """A directory of this test's own in node memory (/dev/shm, where torchrevive-run's keepers keep
    their parts; the test's tmp_path where there is none), removed after the test.

    Not the build machine's disk: a keeper refuses a replica that would leave less than
    `RESERVE_FRACTION` of its file system free, and on a disk 90 % full every replica a test sent
    was answered 507 (CI failed so)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        base = Path(tempfile.mkdtemp(prefix="torchrevive-test-", dir=shm))
    else:
        base = tmp_path / "shm"
        base.mkdir()
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def keeper(node_memory: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SnapshotKeeper]:
    """A snapshot keeper serving on loopback, its directory in the test's `node_memory`, and this
    process's environment pointing workers at it (as torchrevive-run's would)."""
    keeper = start_keeper(node_memory)
    for key, value in keeper.address.environ().items():
        monkeypatch.setenv(key, value)
    yield keeper
    keeper.close(timeout=30)
