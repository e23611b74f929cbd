from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support import free_port

from elastic.errors import EnvironmentConfigError, UsageError
from elastic.runtime import (
    SINGLE_PROCESS,
    init_worker,
    parse_launch_env,
    select_device,
    shutdown_worker,
)

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
    ("requested", "local_rank", "gpus", "expected"),
    [
        ("auto", 0, 0, "cpu"),
        ("auto", 1, 2, "cuda:1"),
        ("cpu", 1, 2, "cpu"),
        ("cuda", 0, 1, "cuda:0"),
    ],
)
def test_device_selection(requested: str, local_rank: int, gpus: int, expected: str) -> None:
    assert select_device(requested, local_rank, cuda_device_count=gpus) == torch.device(expected)


def test_cuda_without_gpus_or_with_too_few_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="no CUDA device is visible"):
        select_device("cuda", 0, cuda_device_count=0)
    with pytest.raises(UsageError, match="LOCAL_RANK=2 has no GPU: only 2 visible"):
        select_device("auto", 2, cuda_device_count=2)


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


def test_warns_when_restarts_would_share_the_worker_store(caplog) -> None:
    import logging

    from elastic.runtime import warn_if_restarts_share_a_store

    with caplog.at_level(logging.WARNING):
        warn_if_restarts_share_a_store({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_MAX_RESTARTS": "3"})
        warn_if_restarts_share_a_store({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "0"})
        assert not caplog.records
        warn_if_restarts_share_a_store({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"})
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in caplog.text
