"""The store a worker's process group bootstraps from: sealed with the job's secret, bound to its round.

A process group's ranks meet through a c10d store: gloo's address of every rank goes in, and every rank
connects to what it reads. torchrun's worker store accepts anyone's writes, so a stranger who reaches it
could hand a rank a stranger's address. When the worker has the job's secret
(TORCHREVIVE_SNAPSHOT_SECRET_FILE, from its agent) and its agent said which launch and round it starts
in (elastic._shared.protocol.round_identity: agents on our rendezvous handlers say so), the store
`init_process_group` gets is a `SealedStore` in `worker_scope(run, launch, round)`: every value a rank
reads verified, or it waits for one that does (elastic._shared.storage.sealed_store).

- With a store per round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which torchrevive-run sets): rank 0
  serves it at MASTER_ADDR:MASTER_PORT, as torch's env:// rendezvous would, the others connect.
- With torchrun's shared agent store: every rank connects to it. A dead round's keys are still there,
  sealed for that round: they read as absent, so no namespace handshake is needed (round_store's is,
  without a seal).
- Without a secret or a round (an unsigned job, torch's own rendezvous handlers): `round_store` as
  before, unsealed.
- A Slurm step with no agent (`srun python script.py`: rank 0 serves the step's store) is sealed in
  `slurm_scope`: the job, its requeue (SLURM_RESTART_COUNT) and the step (SLURM_STEP_ID), which Slurm
  gives every task of the step alike and no earlier step or requeue shared.

Invariant: rank 0 serves without waiting for the others to connect (no `world_size`, so no counter of
the store's own that a stranger's value could break); the bootstrap's waits are the process group's,
bounded by the collective timeout.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from elastic._shared.common.errors import EnvironmentConfigError
from elastic._shared.common.errors import first_line as _first_line
from elastic._shared.protocol import round_identity
from elastic._shared.slurm.control import SlurmControlError, node_address
from elastic._shared.slurm.step import SlurmTask
from elastic._shared.storage.peer_auth import PeerKey, SecretError
from elastic._shared.storage.sealed_store import SealedStore
from elastic._worker.runtime.round_store import (
    LISTENER_WAIT_S,
    RoundStoreError,
    await_store_server,
    connect_agent_store,
    round_store,
    uses_agent_store,
)


def worker_store(
    environ: Mapping[str, str], *, rank: int, world_size: int, timeout: timedelta, slurm_task: SlurmTask | None = None
) -> dist.Store | None:
    """The store for this worker's `init_process_group` (see the module docstring): of `slurm_task`'s step
    when given; None: torch's env://."""
    try:
        key = PeerKey.from_env(environ)
    except SecretError as error:
        raise EnvironmentConfigError(str(error)) from None
    if slurm_task is not None:
        store = slurm_step_store(slurm_task, environ, timeout)
        return store if key is None else SealedStore(store, key, slurm_scope(slurm_task, environ))
    identity = round_identity.read(environ)
    if key is None or identity is None:
        return round_store(environ, rank=rank, world_size=world_size, timeout=timeout)
    scope = round_identity.worker_scope(environ.get("TORCHELASTIC_RUN_ID") or "none", identity)
    if uses_agent_store(environ):
        inner = connect_agent_store(environ, rank=rank, timeout=timeout)
    else:
        inner = _round_server(environ, rank=rank, timeout=timeout)
    return SealedStore(inner, key, scope)


def slurm_scope(task: SlurmTask, environ: Mapping[str, str]) -> str:
    """The scope of a Slurm step's own store (see the module docstring)."""
    step = environ.get("SLURM_STEP_ID", "")
    return f"slurm-step\n{task.restart_count}\n{step if step.isascii() and step.isdigit() else '?'}\n{task.job_id}"


def slurm_step_store(task: SlurmTask, environ: Mapping[str, str], timeout: timedelta) -> dist.Store:
    """A Slurm step's own store: rank 0 hosts a TCP store on the step's first node, the others connect;
    a step of one task needs no port (`srun -n1 python script.py` beside other steps)."""
    if task.world_size == 1:
        return dist.HashStore()
    try:
        host = environ.get("MASTER_ADDR") or node_address(task.nodes[0])
    except SlurmControlError as exc:
        raise EnvironmentConfigError(f"Slurm step: {exc}; set MASTER_ADDR to the first node's address") from None
    try:
        return dist.TCPStore(
            host, task.master_port, task.world_size, is_master=task.rank == 0, timeout=timeout,
            wait_for_workers=False,
        )
    except (RuntimeError, ValueError) as exc:  # DistNetworkError / DistStoreError are RuntimeErrors
        where = "listen" if task.rank == 0 else "reach rank 0"
        raise EnvironmentConfigError(
            f"Slurm step: rank {task.rank} cannot {where} at {host}:{task.master_port} ({_first_line(exc)}); "
            "set MASTER_PORT to a free port"
        ) from None


def _round_server(environ: Mapping[str, str], *, rank: int, timeout: timedelta) -> dist.TCPStore:
    """This round's store at MASTER_ADDR:MASTER_PORT: served by rank 0, reached by the others."""
    addr, port = environ.get("MASTER_ADDR", ""), environ.get("MASTER_PORT", "")
    if not addr or not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise EnvironmentConfigError(f"MASTER_ADDR={addr!r} MASTER_PORT={port!r} do not name the round's store")
    if rank != 0:
        await_store_server(environ, deadline=time.monotonic() + min(timeout.total_seconds(), LISTENER_WAIT_S))
    try:
        return dist.TCPStore(addr, int(port), None, is_master=rank == 0, timeout=timeout, wait_for_workers=False,
                             multi_tenant=True)
    except (RuntimeError, ValueError) as exc:  # DistNetworkError / DistStoreError are RuntimeErrors
        where = "serve" if rank == 0 else "reach"
        raise RoundStoreError(f"rank {rank}: cannot {where} the round's worker store at {addr}:{port} within "
                              f"{timeout}: {_first_line(exc)}") from exc
