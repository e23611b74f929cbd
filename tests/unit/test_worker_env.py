"""The worker's environment is read once, into a `WorkerEnv`, and only elastic/_worker/runtime/worker_env.py
reads the process's (issue 53: settings parsed once per side)."""

from __future__ import annotations

import dataclasses
import signal
import socket
from pathlib import Path

import pytest
import torch
from support import REPO

from elastic._shared.common.errors import UsageError
from elastic._shared.protocol import worker_notes
from elastic._shared.storage.keeper_address import NODE_ENV
from elastic._worker.runtime.context import WorkerContext, init_worker
from elastic._worker.runtime.worker_env import WorkerEnv

WORKER = REPO / "elastic" / "_worker"
READER = WORKER / "runtime" / "worker_env.py"


def test_a_mapping_gives_the_typed_fields() -> None:
    env = WorkerEnv.read({NODE_ENV: "node-a", worker_notes.NOTES_ENV: "/notes", "LOCAL_RANK": "3", "RANK": "11"})
    assert (env.node, env.notes_dir, env.local_rank, env.rank_hint) == ("node-a", "/notes", 3, 11)
    assert env.host == socket.gethostname() and env.variables["RANK"] == "11"
    assert env.preemption == {"requeue_signum": None, "duplicate_window": 0.0}  # outside a Slurm job


def test_the_node_falls_back_to_the_host_and_unset_or_bad_values_are_none() -> None:
    for environ in ({}, {NODE_ENV: "", worker_notes.NOTES_ENV: "", "LOCAL_RANK": "", "RANK": ""},
                    {"LOCAL_RANK": "one", "RANK": "-1"}, {"RANK": "²"}):
        env = WorkerEnv.read(environ)
        assert env.node == env.host == socket.gethostname()
        assert (env.notes_dir, env.local_rank, env.rank_hint) == (None, None, None)
    assert WorkerEnv.bare() == WorkerEnv.read({})


def test_inside_a_slurm_job_the_preemption_settings_are_read_and_a_bad_signal_refused_when_asked() -> None:
    env = WorkerEnv.read({"SLURM_JOB_ID": "7", "TORCHREVIVE_REQUEUE_SIGNAL": "USR2"})
    assert env.preemption["requeue_signum"] == signal.SIGUSR2 and env.preemption["duplicate_window"] > 0
    misnamed = WorkerEnv.read({"SLURM_JOB_ID": "7", "TORCHREVIVE_REQUEUE_SIGNAL": "TERM"})  # reading it is fine
    with pytest.raises(UsageError, match="TERM"):
        misnamed.preemption


def test_it_is_a_read_only_copy_taken_once(monkeypatch: pytest.MonkeyPatch) -> None:
    source = {"RANK": "1"}
    env = WorkerEnv.read(source)
    source["RANK"] = "2"
    assert env.variables["RANK"] == "1" and env.rank_hint == 1
    with pytest.raises(TypeError):
        env.variables["RANK"] = "3"  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.node = "elsewhere"  # type: ignore[misc]
    monkeypatch.setenv(NODE_ENV, "before")
    process = WorkerEnv.read()
    monkeypatch.setenv(NODE_ENV, "after")
    assert process.node == "before" and process.variables[NODE_ENV] == "before"
    assert "variables" not in repr(process)  # never printed: it may hold the job's secret


def test_the_context_carries_the_environment_it_opened_with() -> None:
    env = WorkerEnv.read({NODE_ENV: "node-b"})
    ctx = init_worker("cpu", env=env)
    assert ctx.env is env and ctx.world_size == 1
    assert init_worker("cpu", environ={NODE_ENV: "node-c"}).env.node == "node-c"
    with pytest.raises(ValueError, match="not both"):
        init_worker("cpu", env=env, environ={})
    moved = dataclasses.replace(ctx, rank=0, world_size=1)  # a group changed in place keeps it
    assert moved.env is env
    by_hand = WorkerContext(rank=0, local_rank=0, world_size=1, local_world_size=1, restart_count=0, run_id="t",
                            device=torch.device("cpu"), backend=None)
    assert by_hand.env == WorkerEnv.bare() and "env" not in repr(by_hand)


def mentions_of_the_process_environment() -> list[Path]:
    return sorted(path.relative_to(REPO) for path in WORKER.rglob("*.py") if "os.environ" in path.read_text())


def test_only_worker_env_reads_the_process_environment_on_the_worker_side() -> None:
    assert mentions_of_the_process_environment() == [READER.relative_to(REPO)]


def test_the_shared_readers_the_worker_calls_take_its_environment_and_never_fall_back_to_the_process() -> None:
    """The worker side reads no variable behind WorkerEnv's back: every shared helper it calls that reads
    one (the job's secret, the keeper's address, TLS, the fault hook, the round's identity, the notes)
    takes the mapping as an argument with no default, so a call that forgets it fails at once."""
    import inspect

    from elastic._shared.protocol import fault_hook, round_identity
    from elastic._shared.storage import peer_auth
    from elastic._shared.storage.keeper_address import KeeperAddress

    readers = [peer_auth.PeerKey.from_env, peer_auth.client_tls, peer_auth.server_tls, KeeperAddress.from_env,
               fault_hook.for_worker, round_identity.read, round_identity.publish, worker_notes.for_worker]
    for reader in readers:
        environ = inspect.signature(reader).parameters["environ"]
        assert environ.default is inspect.Parameter.empty, f"{reader.__qualname__} falls back to os.environ"
    with pytest.raises(TypeError):
        peer_auth.PeerKey.from_env()  # type: ignore[call-arg]
