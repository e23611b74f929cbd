"""Fixtures of the integration tier: servers a test starts in its own process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support import start_keeper

from elastic._agent.launcher.keeper import SnapshotKeeper


@pytest.fixture
def keeper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SnapshotKeeper]:
    """A snapshot keeper serving on loopback, its directory under the test's tmp_path, and this
    process's environment pointing workers at it (as torchrevive-run's would)."""
    keeper = start_keeper(tmp_path / "shm")
    for key, value in keeper.address.environ().items():
        monkeypatch.setenv(key, value)
    yield keeper
    keeper.close(timeout=30)
