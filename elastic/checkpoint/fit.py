"""Does a checkpoint (or snapshot) fit this run? Checked on rank 0 before anything is read or changed.

A checkpoint of another model, optimizer, data set or set of extra objects is
one `CheckpointMismatchError` line naming the first difference, raised before
the live state is touched (compat.py does the same for format 1's whole files).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from elastic.checkpoint import state as live_state
from elastic.checkpoint.training_state import TrainingState
from elastic.errors import CheckpointMismatchError
from elastic.storage import sharded


def check_fits(name: str, metadata: Metadata | None, trainer: dict[str, Any], state: TrainingState) -> None:
    """`CheckpointMismatchError` unless the checkpoint `name` fits `state` (its tensors, when
    `metadata` is given: format 2; its trainer state always)."""
    if metadata is not None:
        check_tensors(name, metadata, trainer, state)
    check_trainer(name, trainer, state)


def check_tensors(name: str, metadata: Metadata, trainer: dict[str, Any], state: TrainingState) -> None:
    """The saved tensors and optimizer groups fit the live model and optimizer."""
    model, optimizer = state.model, state.optimizer
    saved = sharded.tensor_shapes(metadata)
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
    if set(saved_extra) != set(state.extra):
        raise CheckpointMismatchError(
            f"checkpoint {name} holds extra state {sorted(saved_extra)}, this run registers "
            f"{sorted(state.extra)}; register the same objects to resume"
        )
