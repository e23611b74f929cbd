"""Read a model's weights from a checkpoint directory, outside a training job.

For tools that only want the newest trained weights (sampling text from a
GPT, an evaluation script): one process, no process group, no optimizer or
sampler to build.

    name, step, state = load_newest_model_state(args.ckpt_dir)
    model.load_state_dict(state)

Invariants:
- Read only: nothing in the directory is written, moved or deleted, corrupt
  checkpoints included; a training job may be saving into it meanwhile.
- A checkpoint is good exactly when every byte of it verifies: its manifest
  names its step, every file has its size and checksum, and every tensor
  chunk its crc32c (format 2; format 1: every file its sha256). The newest
  good one wins; the `latest` pointer is not trusted.
- No pickled code runs: tensors are raw bytes (format 2), and format 1's
  model.pt is loaded with weights_only=True; the optimizer is never unpickled.
- Tensors saved in shards (FSDP2, any world size) come back whole.
- Every failure to find a good checkpoint is a `CheckpointError` of one line.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from elastic._shared.common.errors import CheckpointError, CorruptCheckpoint
from elastic._shared.common.errors import first_line as _one_line
from elastic._shared.storage import sharded, tensors_json
from elastic._shared.storage.directory import CheckpointStore
from elastic._shared.storage.checkpoint_storage import CheckpointStorage
from elastic._shared.storage.stores import open_store
from elastic._shared.storage.manifest import (
    MODEL_FILE,
    TRAINER_FILE,
    Candidate,
    Manifest,
)
from elastic._worker.checkpoint.state import MODEL_PREFIX

logger = logging.getLogger(__name__)


def load_newest_model_state(
    directory: str | os.PathLike[str], *, map_location: torch.device | str = "cpu"
) -> tuple[str, int, dict[str, torch.Tensor]]:
    """The newest good checkpoint's name, step and model state dict, loaded onto `map_location`.

    Corrupt checkpoints are skipped with a warning (and left where they are);
    raises `CheckpointError` when `directory` is missing, holds no committed
    checkpoint, or none of them verifies.
    """
    store = open_store(os.fspath(directory))  # a directory, or a bucket (checked: one line if unusable)
    if isinstance(store, CheckpointStore) and not store.root.exists():
        raise CheckpointError(f"checkpoint directory {store.root} does not exist")
    if isinstance(store, CheckpointStore) and not store.root.is_dir():
        raise CheckpointError(f"checkpoint directory {store.root} is not a directory")
    try:
        candidates = store.committed()
    except OSError as exc:
        raise CheckpointError(f"cannot list checkpoint directory {store.root}: {exc.strerror or exc}") from None
    if not candidates:
        raise CheckpointError(f"{store.root} holds no committed checkpoint")
    corrupt: list[str] = []
    for candidate in candidates:
        try:
            state = _read_model(store, candidate, map_location)
        except CorruptCheckpoint as exc:
            if candidate.name not in {c.name for c in store.committed()}:
                # A running job retired it after we listed it: not damage, just gone.
                logger.info("checkpoint %s was removed while being read; trying the previous one", candidate.name)
                continue
            reason = _one_line(exc)
            logger.warning("checkpoint %s is corrupt (%s); trying the previous one", candidate.path, reason)
            corrupt.append(reason)
            continue
        return candidate.name, candidate.step, state
    if not corrupt:
        raise CheckpointError(f"every checkpoint in {store.root} was removed while being read; try again")
    raise CheckpointError(f"no checkpoint in {store.root} verifies ({len(corrupt)} corrupt, newest: {corrupt[0]})")


def _read_model(store: CheckpointStorage[Any], candidate: Candidate, map_location: torch.device | str) -> dict[str, Any]:
    """The verified model state of one checkpoint; `CorruptCheckpoint` if it is not one."""
    try:
        manifest = store.verify(candidate)
        if manifest.format >= 2:
            trainer = store.load_state_file(candidate, manifest, TRAINER_FILE)
            tensors = read_tensors(store, candidate, manifest, trainer, prefix=MODEL_PREFIX)
            return {
                key[len(MODEL_PREFIX) :]: t.to(map_location) if isinstance(t, torch.Tensor) else t
                for key, t in tensors.items()
            }
        state = store.load_state_file(candidate, manifest, MODEL_FILE, map_location=map_location)
    except OSError as exc:  # not damage (permissions, I/O): falling back would hide it
        raise CheckpointError(f"cannot read {candidate.path}: {exc.strerror or exc}") from None
    if not isinstance(state, dict) or not all(isinstance(key, str) for key in state):
        raise CorruptCheckpoint(f"{candidate.name}/{MODEL_FILE} holds a {type(state).__name__}, not a state dict")
    return state


def read_tensors(
    store: CheckpointStorage[Any], candidate: Candidate, manifest: Manifest, trainer: dict[str, Any], *, prefix: str = ""
) -> dict[str, Any]:
    """A format-2 checkpoint's state whose keys start with `prefix`, whole, on CPU (one process):
    every tensor, a tied one under each of its names, and modules' extra state."""
    # trainer.pt verifies, but need not be what this runtime writes (a crafted one loads weights-only too).
    if not isinstance(trainer, dict) or not all(isinstance(trainer.get(k, {}), dict) for k in ("aliases", "module_extra")):
        raise CorruptCheckpoint(f"{candidate.name}/{TRAINER_FILE} is not a trainer state of this runtime")
    metadata = store.tensor_metadata(candidate, manifest)
    keys = [key for key in tensors_json.tensor_shapes(metadata) if key.startswith(prefix)]
    source = store.chunk_source(candidate.path)  # a bucket's ranged reads; None: the files
    state: dict[str, Any] = dict(sharded.full_tensors(candidate.path, metadata, keys, source=source))
    for alias, first in trainer.get("aliases", {}).items():
        if first in state:
            state[alias] = state[first]
    for key, value in trainer.get("module_extra", {}).items():
        if (MODEL_PREFIX + key).startswith(prefix):
            state[MODEL_PREFIX + key] = value
    return state


def read_checkpoint(path: str | os.PathLike[str]) -> tuple[Manifest, dict[str, torch.Tensor], dict[str, Any]]:
    """One checkpoint directory, verified: its manifest, every tensor whole by key
    (`model/<name>`, `optim/<param>/<state>`) and its trainer state (sampler, RNG, ...).

    For tools and tests; format 1 checkpoints come back under the same keys for the model."""
    directory = Path(path)
    store = CheckpointStore(directory.parent)
    try:
        step = int(directory.name.split("_")[1])
    except (IndexError, ValueError):
        raise CheckpointError(f"{directory} is not a checkpoint directory (step_NNNNNNNN)") from None
    candidate = Candidate(directory.name, step, directory)
    try:
        manifest = store.verify(candidate)
        trainer = store.load_state_file(candidate, manifest, TRAINER_FILE)
        if manifest.format >= 2:
            return manifest, read_tensors(store, candidate, manifest, trainer), trainer
        model = store.load_state_file(candidate, manifest, MODEL_FILE)
        return manifest, {MODEL_PREFIX + key: value for key, value in model.items()}, trainer
    except CorruptCheckpoint as exc:
        raise CheckpointError(f"{directory} does not verify: {exc}") from None
