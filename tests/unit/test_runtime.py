from __future__ import annotations

import logging
import os
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from support import free_port

from elastic._shared.common.errors import EnvironmentConfigError, UsageError
from elastic._worker.runtime import context as runtime
from elastic._worker.runtime.context import (
    error_teardown,
    init_worker,
    select_device,
    shutdown_worker,
)
from elastic._worker.runtime.worker_env import SINGLE_PROCESS, parse_launch_env

TORCHRUN_ENV = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "TORCHELASTIC_RESTART_COUNT": "2",
    "TORCHELASTIC_RUN_ID": "job7",
}


def test_plain_python_is_a_single_process_job() -> None:
    assert parse_launch_env({}) == SINGLE_PROCESS
    assert SINGLE_PROCESS.world_size == 1 and not SINGLE_PROCESS.launched


def test_torchrun_environment_is_read_in_full() -> None:
    env = parse_launch_env(TORCHRUN_ENV)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert (env.restart_count, env.run_id, env.launched) == (2, "job7", True)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"WORLD_SIZE": None}, "WORLD_SIZE is not set"),
        ({"RANK": "two"}, "RANK='two' is not an integer"),
        ({"RANK": "-1"}, "RANK=-1 is negative"),
        ({"RANK": "4"}, "RANK=4 is outside WORLD_SIZE=4"),
        ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE=0 must be at least 1"),
        ({"LOCAL_RANK": "2"}, "LOCAL_RANK=2 is outside LOCAL_WORLD_SIZE=2"),
        ({"LOCAL_WORLD_SIZE": "5"}, "LOCAL_WORLD_SIZE=5 must be between 1 and WORLD_SIZE=4"),
        ({"TORCHELASTIC_RESTART_COUNT": "x"}, "TORCHELASTIC_RESTART_COUNT='x' is not an integer"),
    ],
)
def test_bad_environment_names_the_variable(override: dict[str, str | None], message: str) -> None:
    env = {**TORCHRUN_ENV, **override}
    env = {k: v for k, v in env.items() if v is not None}
    with pytest.raises(EnvironmentConfigError, match=message):
        parse_launch_env(env)


def test_missing_local_variables_default_to_a_one_worker_node() -> None:
    env = parse_launch_env({"RANK": "0", "WORLD_SIZE": "2"})
    assert (env.local_rank, env.local_world_size, env.restart_count) == (0, 1, 0)


@pytest.mark.parametrize(
    ("requested", "local_rank", "local_world_size", "gpus", "expected"),
    [
        ("auto", 0, 1, 0, "cpu"),
        ("auto", 1, 2, 2, "cuda:1"),
        ("auto", 1, 2, 8, "cuda:1"),
        ("cpu", 1, 2, 2, "cpu"),
        ("cuda", 0, 1, 1, "cuda:0"),
        # One GPU visible per process (Slurm --gpus-per-task, a GPU per container): it is cuda:0.
        ("cuda", 1, 2, 1, "cuda:0"),
        ("auto", 3, 4, 1, "cuda:0"),
    ],
)
def test_device_selection(requested: str, local_rank: int, local_world_size: int, gpus: int, expected: str) -> None:
    device = select_device(requested, local_rank, local_world_size, cuda_device_count=gpus)
    assert device == torch.device(expected)


def test_cuda_without_gpus_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="no CUDA device is visible"):
        select_device("cuda", 0, 1, cuda_device_count=0)


@pytest.mark.parametrize("local_rank", [0, 1, 2])
def test_fewer_gpus_than_local_workers_but_more_than_one_is_one_line_on_every_rank(local_rank: int) -> None:
    """2 GPUs visible to each of 3 workers: every local rank fails alike, none waits for the others."""
    with pytest.raises(UsageError) as raised:
        select_device("auto", local_rank, 3, cuda_device_count=2)
    message = str(raised.value)
    assert "\n" not in message
    assert f"LOCAL_RANK={local_rank} has no GPU: 2 are visible to each of the 3 workers" in message
    assert "--nproc-per-node=2" in message and "exactly one GPU visible to each" in message


def test_single_process_worker_has_no_process_group() -> None:
    ctx = init_worker("cpu", environ={})
    assert (ctx.rank, ctx.world_size, ctx.is_main, ctx.distributed) == (0, 1, True, False)
    assert not dist.is_initialized()


def test_launched_worker_joins_and_leaves_a_gloo_process_group() -> None:
    environ = {
        "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
    }
    with pytest.MonkeyPatch.context() as mp:
        for key, value in environ.items():
            mp.setenv(key, value)
        ctx = init_worker("cpu", environ=environ)
        try:
            assert ctx.backend == "gloo" and dist.is_initialized()
            assert dist.get_world_size() == 1
        finally:
            shutdown_worker()
    assert not dist.is_initialized()
    shutdown_worker()  # idempotent


def test_a_launched_worker_leaves_nccl_async_error_handling_to_the_launcher(monkeypatch) -> None:
    """torchrun sets TORCH_NCCL_ASYNC_ERROR_HANDLING itself; elsewhere torch's default stands."""
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    environ = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(runtime, "select_device", lambda *args, **kwargs: torch.device("cpu"))
    monkeypatch.setattr(runtime, "backend_for", lambda device: "nccl")  # the NCCL path, on a gloo group
    monkeypatch.setattr(dist, "new_group", lambda **kwargs: None)
    real_init = dist.init_process_group
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: real_init("gloo", **kwargs))
    init_worker("cpu", environ=environ)
    try:
        assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ
    finally:
        shutdown_worker()


def test_error_teardown_aborts_nccl_and_destroys_gloo() -> None:
    """NCCL's destroy flushes its communicators (waits on peers); abort does not. gloo's destroy is local."""
    abort = dist.distributed_c10d._abort_process_group
    assert error_teardown("nccl") is abort
    assert error_teardown("cpu:gloo,cuda:nccl") is abort
    assert error_teardown("gloo") is dist.destroy_process_group


class FakeNcclWorld:
    """A process group that claims to be NCCL, recording how it was torn down."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, abort_blocks: bool = False) -> None:
        self.calls: list[str] = []
        self.release = threading.Event()
        self.abort_blocks = abort_blocks
        self.initialized = True
        monkeypatch.setattr(dist, "is_initialized", lambda: self.initialized)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        monkeypatch.setattr(dist, "get_rank", lambda group=None: 5)
        monkeypatch.setattr(dist, "destroy_process_group", self.destroy)
        monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", self.abort)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)

    def destroy(self, group=None) -> None:
        self.calls.append("destroy")
        self.initialized = False

    def abort(self, group=None) -> None:
        self.calls.append("abort")
        if self.abort_blocks:
            self.release.wait()  # ncclCommAbort stuck on a dead peer
        self.initialized = False


def test_a_failed_worker_aborts_an_nccl_group_instead_of_destroying_it(monkeypatch) -> None:
    world = FakeNcclWorld(monkeypatch)
    shutdown_worker(failed=True)
    assert world.calls == ["abort"]


def test_a_normal_exit_destroys_an_nccl_group(monkeypatch) -> None:
    world = FakeNcclWorld(monkeypatch)
    shutdown_worker()
    assert world.calls == ["destroy"]


def test_a_teardown_that_hangs_is_left_behind_after_the_deadline_with_one_line(monkeypatch, caplog) -> None:
    world = FakeNcclWorld(monkeypatch, abort_blocks=True)
    try:
        with caplog.at_level(logging.WARNING, logger="elastic._worker.runtime.context"):
            shutdown_worker(failed=True, deadline=timedelta(seconds=0.2))  # returns: the test would time out otherwise
        assert world.calls == ["abort"]
        [record] = caplog.records
        assert "rank 5: leaving the process group after a failure took over" in record.getMessage()
        assert "leaving it to process exit" in record.getMessage() and not record.exc_info
    finally:
        world.release.set()
        wait_for_teardowns()  # process-global: the next test must not find this one's teardown still running


def wait_for_teardowns() -> None:
    """Until every teardown this process left behind has ended (they end once their destructor returns)."""
    pause = threading.Event()  # never set: a sleep
    for _ in range(600):
        if not runtime.teardown_pending():
            return
        pause.wait(0.05)
    assert not runtime.teardown_pending(), "a teardown left behind never ended"


def test_a_worker_whose_teardown_overran_joins_no_new_group(monkeypatch) -> None:
    """gloo's destroy clears the world at once, then its destructor waits for a collective still in
    flight (a peer blocked on this rank): the group's sockets stay open until it ends. A heal must not
    go on to a new group then; the worker leaves, and its exit closes them."""
    from elastic._worker.survivors import regroup

    world = FakeNcclWorld(monkeypatch)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")

    def destroy_then_wait(group=None) -> None:
        world.initialized = False  # torch forgets the group first...
        world.release.wait()  # ...then ~ProcessGroupGloo joins its worker threads

    monkeypatch.setattr(dist, "destroy_process_group", destroy_then_wait)
    monkeypatch.setitem(runtime.shutdown_worker.__kwdefaults__, "deadline", timedelta(seconds=0.2))
    try:
        assert not runtime.teardown_pending()
        regroup.leave()
        assert not dist.is_initialized() and runtime.teardown_pending()
        with pytest.raises(regroup.RegroupError, match="could not be left in time for heal 3"):
            regroup.rejoin(object(), generation=3, rank=5, world_size=8)  # the store is never touched
    finally:
        world.release.set()
    wait_for_teardowns()  # the teardown's thread ends once the destructor returns


def test_a_teardown_that_fails_is_one_warning_line(monkeypatch, caplog) -> None:
    FakeNcclWorld(monkeypatch)

    def abort(group=None) -> None:
        raise RuntimeError("NCCL error: remote process exited\nmore detail")

    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", abort)
    with caplog.at_level(logging.WARNING, logger="elastic._worker.runtime.context"):
        shutdown_worker(failed=True)
    [record] = caplog.records
    assert "failed (RuntimeError: NCCL error: remote process exited)" in record.getMessage()
    assert "\n" not in record.getMessage() and not record.exc_info


def test_a_failed_worker_leaves_a_real_gloo_group(monkeypatch) -> None:
    environ = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    init_worker("cpu", environ=environ)
    shutdown_worker(failed=True)
    assert not dist.is_initialized()
    shutdown_worker(failed=True)  # idempotent
