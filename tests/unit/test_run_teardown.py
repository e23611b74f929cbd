"""How `elastic.Run` leaves the process group it made: after a barrier on a normal exit,
without waiting on peers (`shutdown_worker(failed=True)`) when the block or the barrier failed."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from support import free_port

import elastic
from elastic._worker.runtime import context as runtime


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """A one-process torchrun-like environment; returns the `failed` flag of each teardown."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    flags: list[bool] = []

    real_shutdown = runtime.shutdown_worker

    def recording_shutdown(*, failed: bool = False) -> None:
        flags.append(failed)
        real_shutdown(failed=failed)

    monkeypatch.setattr(runtime, "shutdown_worker", recording_shutdown)
    yield flags
    runtime.shutdown_worker()  # whatever a failing test left up


def test_a_normal_exit_destroys_the_group_after_a_barrier(launched: list[bool]) -> None:
    with elastic.Run(device="cpu") as run:
        assert run.distributed
    assert launched == [False] and not dist.is_initialized()


def test_an_error_in_the_block_leaves_without_waiting_on_peers(launched: list[bool]) -> None:
    with pytest.raises(ValueError, match="the step failed"), elastic.Run(device="cpu"):
        raise ValueError("the step failed")
    assert launched == [True] and not dist.is_initialized()


def test_a_failed_leaving_barrier_leaves_without_waiting_on_peers(
    launched: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    def dead_peer(ctx: runtime.WorkerContext) -> None:
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(runtime, "barrier", dead_peer)
    with pytest.raises(RuntimeError, match="Connection closed by peer"), elastic.Run(device="cpu"):
        pass
    assert launched == [True] and not dist.is_initialized()


def test_worker_context_leaves_without_waiting_on_peers_when_its_barrier_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    flags: list[bool] = []
    real_shutdown = runtime.shutdown_worker

    def recording_shutdown(*, failed: bool = False) -> None:
        flags.append(failed)
        real_shutdown(failed=failed)

    def dead_peer(ctx: runtime.WorkerContext) -> None:
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(runtime, "shutdown_worker", recording_shutdown)
    monkeypatch.setattr(runtime, "barrier", dead_peer)
    with pytest.raises(RuntimeError, match="Connection closed by peer"), runtime.worker_context("cpu"):
        pass
    assert flags == [True] and not dist.is_initialized()
