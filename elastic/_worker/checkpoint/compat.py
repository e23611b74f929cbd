"""Does a checkpoint belong to this model and optimizer? Checked before anything is loaded.

A checkpoint from another model must fail with one line that names the first
key that differs and both shapes, not with a page of `load_state_dict` output
or, worse, a silent partial load. The checks run before any live state is
touched, so a failed restore leaves the model, optimizer and checkpoint
directory exactly as they were.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from elastic._shared.common.errors import CheckpointMismatchError


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(d) for d in t.shape) + "]"


def check_model(name: str, live: Mapping[str, torch.Tensor], saved: Mapping[str, Any]) -> None:
    """Same keys, same shapes, same dtypes; raises on the first difference."""
    for key, tensor in live.items():
        if key not in saved:
            raise CheckpointMismatchError(
                f"checkpoint {name} is for another model: it has no {key} (shape {_shape(tensor)} here)"
            )
        other = saved[key]
        if not isinstance(other, torch.Tensor) or other.shape != tensor.shape:
            there = _shape(other) if isinstance(other, torch.Tensor) else type(other).__name__
            raise CheckpointMismatchError(
                f"checkpoint {name} is for another model: {key} has shape {there} there and {_shape(tensor)} here"
            )
    for key in saved:
        if key not in live:
            raise CheckpointMismatchError(f"checkpoint {name} is for another model: it has {key}, which this model lacks")


def check_optimizer(name: str, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> None:
    """Same kind of optimizer over the same parameter shapes."""
    live_groups = optimizer.param_groups
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(live_groups):
        raise CheckpointMismatchError(
            f"checkpoint {name} is for another optimizer: {len(saved_groups)} parameter groups there, "
            f"{len(live_groups)} here"
        )
    params: dict[int, torch.Tensor] = {}
    for index, (live, other) in enumerate(zip(live_groups, saved_groups)):
        live_keys, saved_keys = set(live) - {"params"}, set(other) - {"params"}
        if live_keys != saved_keys:
            differing = sorted(live_keys ^ saved_keys)[0]
            raise CheckpointMismatchError(
                f"checkpoint {name} is for another optimizer: setting {differing!r} of group {index} "
                f"is in only one of them"
            )
        if len(other["params"]) != len(live["params"]):
            raise CheckpointMismatchError(
                f"checkpoint {name} is for another optimizer: group {index} has {len(other['params'])} "
                f"parameters there and {len(live['params'])} here"
            )
        params.update(zip(other["params"], live["params"]))
    for param_id, state in saved["state"].items():
        param = params.get(param_id)
        if param is None:
            raise CheckpointMismatchError(f"checkpoint {name} has optimizer state for unknown parameter {param_id}")
        for key, value in state.items():
            # Per-parameter moments (exp_avg, momentum_buffer, ...) have the parameter's shape.
            if isinstance(value, torch.Tensor) and value.dim() == param.dim() and value.shape != param.shape:
                raise CheckpointMismatchError(
                    f"checkpoint {name} is for another model: optimizer state {key} of parameter {param_id} "
                    f"has shape {_shape(value)} there and {_shape(param)} here"
                )
