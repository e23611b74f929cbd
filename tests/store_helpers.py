"""Checkpoints made by hand for the store's tests: format-2 saves of one rank, claims, leftovers."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import crc32c
import torch

from elastic._shared.storage import claim as claims
from elastic._shared.storage import sharded
from elastic._shared.storage.claim import WriterIdentity
from elastic._shared.storage.directory import CheckpointStore
from elastic._shared.storage.manifest import Manifest, versions


def manifest_for(step: int, files: dict, *, run_id: str = "run-a") -> Manifest:
    return Manifest(
        step=step, epoch=0, consumed=step * 8, world_size=1, files=files, created=time.time(),
        reason="periodic", run_id=run_id, versions=versions(),
    )


def save(store: CheckpointStore, step: int, *, owner: WriterIdentity | None = None, value: float | None = None, **kwargs) -> Path:
    """A format-2 checkpoint of one rank: shard file, tensors.json, trainer.pt, manifest."""
    tmp = store.begin(step, "t" + os.urandom(4).hex())
    fill = float(step) if value is None else value
    sharded.save_tensors({"model/w": torch.full((8, 4), fill), "model/n": torch.tensor(step)}, tmp, group=None)
    files = {name: {"bytes": (tmp / name).stat().st_size} for name in (sharded.shard_file(0),)}
    text = (tmp / sharded.TENSORS_FILE).read_bytes()
    files[sharded.TENSORS_FILE] = {"bytes": len(text), "crc32c": crc32c.crc32c(text)}
    files["trainer.pt"] = store.write_state_file(tmp, "trainer.pt", {"step": step, "fill": fill})
    return store.finish(tmp, manifest_for(step, files), owner=owner, **kwargs)


def weights(store: CheckpointStore, step: int) -> torch.Tensor:
    (candidate,) = [c for c in store.committed() if c.step == step]
    manifest = store.verify(candidate)
    metadata = store.tensor_metadata(candidate, manifest)
    return sharded.full_tensors(candidate.path, metadata, ["model/w"])["model/w"]


def claim_of(run_id: str, *, pid: int, host: str | None = None, heartbeat: float | None = None) -> WriterIdentity:
    """The claim process `pid` would write (a pid that is gone gets a start time no process has)."""
    identity = WriterIdentity.of_process(run_id, pid, writer=f"w-{run_id}-{pid}", host=host, heartbeat=heartbeat)
    if identity.start_time < 0:
        identity = replace(identity, start_time=1, pid_ns=claims.pid_namespace())
    return identity


def leftovers(root: Path) -> dict[str, bytes]:
    tmp = root / ".tmp.step_00000300.other"
    tmp.mkdir()
    (tmp / "shard_00000.bin").write_bytes(b"half written")
    return {"dir": tmp.name.encode(), "content": (tmp / "shard_00000.bin").read_bytes()}


def temporaries(ckpt: Path) -> list[str]:
    """The saves in progress (or that died) in a checkpoint directory."""
    return sorted(p.name for p in ckpt.iterdir() if p.name.startswith(".tmp."))


def describe(step: int) -> Callable[[dict], Manifest]:
    """A format-1 commit's `describe`: the manifest of step `step` for the files written."""
    return lambda files: Manifest(
        step=step, epoch=0, consumed=0, world_size=1, files=files, created=0.0, reason="test", run_id="t",
        versions=versions(),
    )
