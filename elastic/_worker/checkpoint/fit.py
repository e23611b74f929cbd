"""Does a checkpoint (or snapshot) fit this run? Checked on rank 0 before anything is read or changed.

A checkpoint of another model, optimizer, data set or set of extra objects is
one `CheckpointMismatchError` line naming the first difference, raised before
the live state is touched (compat.py does the same for format 1's whole files).
A trainer state not of the shape this runtime writes (a crafted one that passes
its checksum) is a `CorruptCheckpoint`: the restore falls back to an older one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from elastic._shared.common.errors import CheckpointMismatchError, CorruptCheckpoint
from elastic._shared.storage import tensors_json
from elastic._worker.checkpoint import state as live_state
from elastic._worker.checkpoint.training_state import (
    RUNTIME_EXTRA_PREFIX,
    TrainingState,
)
from elastic._worker.runtime.rng import get_rng_state, set_rng_state


def check_fits(name: str, metadata: Metadata | None, trainer: dict[str, Any], state: TrainingState) -> None:
    """`CheckpointMismatchError` unless the checkpoint `name` fits `state` (its tensors, when
    `metadata` is given: format 2; its trainer state always)."""
    check_trainer_shape(name, trainer)
    if metadata is not None:
        check_tensors(name, metadata, trainer, state)
    check_trainer(name, trainer, state)


def check_trainer_shape(name: str, trainer: Any) -> None:
    """`CorruptCheckpoint` unless `trainer` has the shape this runtime writes: checked before anything
    live changes, since applying it (`TrainingState.apply_trainer`) comes after the weights are loaded,
    and only on some ranks (rank k sets `rng[k]`). Every rank's RNG state is tried on this process's
    generators (and theirs put back), so no rank can fail on its own later."""

    def bad(why: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"checkpoint {name}: its trainer state {why}")

    if not isinstance(trainer, dict):
        raise bad(f"is a {type(trainer).__name__}, not a dict")
    for key, kinds in (("sampler", (dict,)), ("scheduler", (dict, type(None))), ("scaler", (dict, type(None))),
                       ("rng", (list,)), ("extra", (dict,)), ("optimizer", (list, dict, type(None)))):
        if key == "extra" and key not in trainer:
            continue  # checkpoints from before extra state
        if not isinstance(trainer.get(key), kinds):
            raise bad(f"has {key} of type {type(trainer.get(key)).__name__}")
    sampler = trainer["sampler"]
    for key in ("num_samples", "seed", "epoch", "consumed"):
        if not isinstance(sampler.get(key), int) or isinstance(sampler.get(key), bool) or sampler[key] < 0:
            raise bad(f"has sampler {key} {sampler.get(key)!r}, not a non-negative integer")
    if not trainer["rng"]:
        raise bad("holds no RNG state")
    saved = get_rng_state(torch.device("cpu"))
    try:
        for rank, state in enumerate(trainer["rng"]):
            try:
                set_rng_state(state, torch.device("cpu"))
            except Exception as exc:  # noqa: BLE001 - any way it fails, rank `rank` would fail on it
                raise bad(f"has an RNG state for rank {rank} that does not load ({type(exc).__name__})") from None
    finally:
        set_rng_state(saved, torch.device("cpu"))


def check_tensors(name: str, metadata: Metadata, trainer: dict[str, Any], state: TrainingState) -> None:
    """The saved tensors and optimizer groups fit the live model and optimizer."""
    model, optimizer = state.model, state.optimizer
    saved = tensors_json.tensor_shapes(metadata)
    live = {
        key: value for key, value in live_state.live_tensors(model, optimizer).items()
        if key.startswith(live_state.MODEL_PREFIX)
    }
    live_state.check_shapes(name, live, saved, live_state.MODEL_PREFIX)
    if trainer.get("aliases", {}) != live_state.tied_aliases(model):
        raise CheckpointMismatchError(
            f"checkpoint {name} is for another model: its tied weights {trainer.get('aliases', {})} differ from "
            f"this model's {live_state.tied_aliases(model)}"
        )
    if set(trainer.get("module_extra", {})) != set(live_state.module_extra_state(model)):
        raise CheckpointMismatchError(
            f"checkpoint {name} is for another model: modules with extra state differ "
            f"({sorted(trainer.get('module_extra', {}))} there, {sorted(live_state.module_extra_state(model))} here)"
        )
    params = dict(model.named_parameters())
    for key, (shape, _) in saved.items():
        if not key.startswith(live_state.OPTIM_PREFIX):
            continue
        param_name = key[len(live_state.OPTIM_PREFIX) :].rsplit("/", 1)[0]
        param = params.get(param_name)
        if param is None:
            raise CheckpointMismatchError(
                f"checkpoint {name} is for another model: it has optimizer state for {param_name}, which this "
                "model lacks"
            )
        if len(shape) == param.dim() and shape != param.shape:
            raise CheckpointMismatchError(
                f"checkpoint {name} is for another model: optimizer state {key[len(live_state.OPTIM_PREFIX):]} "
                f"has shape {list(shape)} there and {list(param.shape)} here"
            )
    live_state.check_groups(name, optimizer, model, trainer["optimizer"])


def runtime_owned(name: str) -> bool:
    """An extra object the runtime registers itself (training_state.RUNTIME_EXTRA_PREFIX): a run that
    does not register it resumes a checkpoint that holds it, and the other way round."""
    return name.startswith(RUNTIME_EXTRA_PREFIX)


def check_trainer(name: str, trainer: dict[str, Any], state: TrainingState) -> None:
    """Same data set and seed, a grad scaler on both sides or neither, the same extra objects."""
    sampler_state = trainer["sampler"]
    sampler = state.sampler
    if int(sampler_state["num_samples"]) != sampler.num_samples or int(sampler_state["seed"]) != sampler.seed:
        raise CheckpointMismatchError(
            f"checkpoint {name} is for another data set or seed: {sampler_state['num_samples']} samples "
            f"with seed {sampler_state['seed']} there, {sampler.num_samples} with seed {sampler.seed} here"
        )
    if (trainer["scaler"] is None) != (state.scaler is None):
        raise CheckpointMismatchError(
            f"checkpoint {name} was saved {'without' if trainer['scaler'] is None else 'with'} a grad scaler"
        )
    saved_extra = trainer.get("extra", {})  # checkpoints before extra state have none
    user_saved = sorted(k for k in saved_extra if not runtime_owned(k))
    user_live = sorted(k for k in state.extra if not runtime_owned(k))
    if user_saved != user_live:
        raise CheckpointMismatchError(
            f"checkpoint {name} holds extra state {user_saved}, this run registers "
            f"{user_live}; register the same objects to resume"
        )
