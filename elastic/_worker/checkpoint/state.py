"""The live model and optimizer as one flat dict of tensors, and back.

Keys are stable across world sizes and wrappers: `model/<state_dict key>` and
`optim/<parameter name>/<state name>` (an AdamW moment of `lm_head.weight` is
`optim/lm_head.weight/exp_avg`), never the optimizer's positional ids.

Two kinds of tensors:
- DTensors (FSDP2's sharded parameters and their optimizer moments): each rank
  saves and loads its own shard; DCP reshards when the world size changed.
- Plain tensors (everything under DDP, buffers and step counters under FSDP2):
  the same on every rank, so each is saved by one rank only (`owners` spreads
  them by size) and, on restore, read by one rank and broadcast: every byte is
  written once and read once per job, whatever the world size.

Invariants:
- `check_supported` runs before anything is saved or loaded: a wrapper whose
  state this module cannot save correctly is one `UsageError` line up front.
- The optimizer's non-tensor state (hyperparameters per group, and any
  non-tensor per-parameter value) travels as plain values, by parameter name.

Why not torch.distributed.checkpoint.state_dict (`get_state_dict`,
`set_optimizer_state_dict`), which names tensors the same way: measured with
benchmarks/state_walk.py on 2 CPU cores, its walk costs 13.6x ours at the GPT
recipe's size (2.9 ms against 0.21 ms) and 13.7x at ~100M parameters (9.4 ms
against 0.68 ms), and an in-memory snapshot takes this walk at every step on
a thread that shares the GIL with the loop. And on a fresh optimizer (every
restore, and a save before the first step) it runs `optimizer.step()` with
zero gradients and the learning rate at 0 (its `_init_optim_state`), which
fires the script's optimizer hooks and ours. DCP still does what it is best
at here: planning who writes and reads which chunk, and resharding (storage/sharded.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from elastic._shared.common.errors import CheckpointMismatchError, UsageError
from elastic._worker.checkpoint.snapshot import dtensor_like

MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"
_EXTRA_STATE = "_extra_state"  # torch.nn.Module's key for get_extra_state()


def check_supported(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One line for a model or optimizer whose state this runtime cannot checkpoint correctly."""
    for name, module in model.named_modules():
        kind = type(module)
        if kind.__name__ == "FullyShardedDataParallel" and kind.__module__.startswith("torch.distributed.fsdp"):
            raise UsageError(
                f"{name or 'the model'} is wrapped in FSDP1 (FullyShardedDataParallel), whose state dict is a "
                "collective the background writer cannot run: use FSDP2 (torch.distributed.fsdp.fully_shard, "
                "run.fsdp(model))"
            )
        if kind.__module__.startswith("deepspeed"):
            raise UsageError(
                f"{name or 'the model'} is a DeepSpeed {kind.__name__}: its ZeRO state is partitioned outside "
                "torch's state dicts; use FSDP2 (run.fsdp(model)) instead"
            )
    opt_kind = type(optimizer)
    if opt_kind.__name__ == "ZeroRedundancyOptimizer":
        raise UsageError(
            "ZeroRedundancyOptimizer shards its state without DTensors and needs a consolidation before every "
            "save: use FSDP2 (run.fsdp(model)), which shards the optimizer state as DTensors"
        )
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor) and not all(isinstance(p, (Shard, Replicate)) for p in tensor.placements):
            raise UsageError(f"{name} has placements {tensor.placements}; checkpoints support Shard and Replicate")
    named = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in named:
                raise UsageError("the optimizer holds a parameter that is not the model's: pass the model it trains")


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its name (the first, for a tied weight)."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return names


def _storage_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return (local.data_ptr(), local.dtype, tuple(local.shape), tuple(local.stride()), local.storage_offset())


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Model keys that are the same tensor as an earlier key (a tied embedding): alias -> first key.

    The tensor is saved once, under the first key; the alias is restored by the tie itself."""
    first: dict[tuple[Any, ...], str] = {}
    aliases: dict[str, str] = {}
    for key, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor) or key.endswith(_EXTRA_STATE):
            continue
        if value.numel() == 0:
            continue  # empty tensors share no storage worth naming
        storage = _storage_key(value)
        if storage in first:
            aliases[MODEL_PREFIX + key] = MODEL_PREFIX + first[storage]
        else:
            first[storage] = key
    return aliases


def live_tensors(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    names: Mapping[int, str] | None = None,
    aliases: Mapping[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of the model's state dict and the optimizer's state, by stable key (live, not
    copies); a tied tensor once, under its first key; modules' extra state apart (`module_extra_state`).
    `names` and `aliases` (`parameter_names`, `tied_aliases`) may be given, worked out once."""
    aliases = tied_aliases(model) if aliases is None else aliases
    tensors = {
        MODEL_PREFIX + key: value
        for key, value in model.state_dict().items()
        if isinstance(value, torch.Tensor) and not key.endswith(_EXTRA_STATE) and MODEL_PREFIX + key not in aliases
    }
    names = parameter_names(model) if names is None else names
    for group in optimizer.param_groups:
        for param in group["params"]:
            for state_name, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{OPTIM_PREFIX}{names[id(param)]}/{state_name}"] = value
    return tensors


class Layout:
    """What does not change from one save to the next, worked out once: parameter names, tied
    weights, whether any module has extra state, and who owns which replicated tensor."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self.names = parameter_names(model)
        self.aliases = tied_aliases(model)
        self.buffer_keys = frozenset(MODEL_PREFIX + name for name, _ in model.named_buffers())
        self.sharded = any(isinstance(p, DTensor) for p in model.parameters())
        self._has_extra_state = any(
            type(m).get_extra_state is not torch.nn.Module.get_extra_state for m in model.modules()
        )
        self._owners: dict[Any, dict[str, int]] = {}

    def tensors(self) -> dict[str, torch.Tensor]:
        return live_tensors(self.model, self.optimizer, names=self.names, aliases=self.aliases)

    def share(self, tensors: Mapping[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
        # Under FSDP2 buffers are not kept in step across ranks (DDP broadcasts them): rank 0's are saved.
        return share_of(
            tensors, rank, world_size, from_rank0=self.buffer_keys if self.sharded else frozenset(), cache=self._owners
        )

    def settings(self) -> dict[str, Any]:
        return optimizer_settings(self.model, self.optimizer, names=self.names)

    def extra_state(self) -> dict[str, Any]:
        return module_extra_state(self.model) if self._has_extra_state else {}


def module_extra_state(model: torch.nn.Module) -> dict[str, Any]:
    """What modules return from `get_extra_state` (FP8 scaling metadata, say), by state dict key.

    Not part of the tensors: `state_dict()` hands out a fresh object each time, so
    it is restored through each module's `set_extra_state`."""
    return {key: value for key, value in model.state_dict().items() if key.endswith(_EXTRA_STATE)}


def set_module_extra_state(model: torch.nn.Module, saved: Mapping[str, Any]) -> None:
    modules = dict(model.named_modules())
    for key, value in saved.items():
        module = modules[key[: -len(_EXTRA_STATE)].rstrip(".")]
        module.set_extra_state(value)


def optimizer_settings(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, names: Mapping[int, str] | None = None
) -> dict[str, Any]:
    """The optimizer's non-tensor state by parameter name: group hyperparameters and plain per-parameter values."""
    names = parameter_names(model) if names is None else names
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
        for group in optimizer.param_groups
    ]
    values = {
        names[id(param)]: {k: v for k, v in optimizer.state[param].items() if not isinstance(v, torch.Tensor)}
        for group in optimizer.param_groups
        for param in group["params"]
        if param in optimizer.state
    }
    return {"groups": groups, "values": {k: v for k, v in values.items() if v}}


def nbytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def owners(sizes: Mapping[str, int], world_size: int) -> dict[str, int]:
    """Each replicated key -> the rank that saves (or reads) it: largest first to the least loaded rank.

    Deterministic in its inputs, so every rank computes the same answer alone.
    """
    load = [0] * world_size
    owner: dict[str, int] = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[key] = rank
        load[rank] += sizes[key]
    return owner


def replicated(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Keys of plain tensors (the same on every rank)."""
    return [key for key, value in tensors.items() if not isinstance(value, DTensor)]


def share_of(
    tensors: Mapping[str, torch.Tensor],
    rank: int,
    world_size: int,
    *,
    from_rank0: frozenset[str] = frozenset(),
    cache: dict[Any, dict[str, int]] | None = None,
) -> dict[str, torch.Tensor]:
    """What this rank saves: its shard of every DTensor, the plain tensors it owns, and on
    rank 0 the keys in `from_rank0` (state that may differ per rank: rank 0's copy is saved).
    `cache` keeps the owners of a set of keys and sizes from one save to the next."""
    plain = [key for key in replicated(tensors) if key not in from_rank0]
    sizes = {key: nbytes(tensors[key]) for key in plain}
    signature = (world_size, tuple(sizes.items()))
    owner = cache.get(signature) if cache is not None else None
    if owner is None:
        owner = owners(sizes, world_size)
        if cache is not None:
            cache.clear()
            cache[signature] = owner
    owner = dict(owner)
    owner.update({key: 0 for key in from_rank0 if key in tensors})
    return {key: value for key, value in tensors.items() if isinstance(value, DTensor) or owner[key] == rank}


def host_buffer_like(live: torch.Tensor, shape: torch.Size | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty CPU tensor to load into: a DTensor with the live one's sharding, or a plain tensor."""
    if isinstance(live, DTensor):
        return dtensor_like(torch.empty(live.to_local().shape, dtype=dtype or live.dtype, device="cpu"), live)
    return torch.empty(shape if shape is not None else live.shape, dtype=dtype or live.dtype, device="cpu")


def check_shapes(
    name: str, live: Mapping[str, torch.Tensor], saved: Mapping[str, tuple[torch.Size, torch.dtype]], prefix: str
) -> None:
    """Same keys under `prefix`, same global shapes; `CheckpointMismatchError` on the first difference."""
    what = "model" if prefix == MODEL_PREFIX else "optimizer"
    for key, tensor in live.items():
        if not key.startswith(prefix):
            continue
        short = key[len(prefix) :]
        if key not in saved:
            raise CheckpointMismatchError(
                f"checkpoint {name} is for another {what}: it has no {short} (shape {_shape(tensor.shape)} here)"
            )
        if saved[key][0] != tensor.shape:
            raise CheckpointMismatchError(
                f"checkpoint {name} is for another model: {what} {short} has shape {_shape(saved[key][0])} there "
                f"and {_shape(tensor.shape)} here"
            )
    for key in saved:
        if key.startswith(prefix) and key not in live:
            raise CheckpointMismatchError(
                f"checkpoint {name} is for another {what}: it has {key[len(prefix):]}, which this {what} lacks"
            )


def check_groups(name: str, optimizer: torch.optim.Optimizer, model: torch.nn.Module, saved: Mapping[str, Any]) -> None:
    """Same number of groups, same settings, same parameters in each (by name)."""
    live = optimizer_settings(model, optimizer)["groups"]
    theirs = saved["groups"]
    if len(theirs) != len(live):
        raise CheckpointMismatchError(
            f"checkpoint {name} is for another optimizer: {len(theirs)} parameter groups there, {len(live)} here"
        )
    for index, (here, there) in enumerate(zip(live, theirs)):
        differing = sorted(set(here) ^ set(there))
        if differing:
            raise CheckpointMismatchError(
                f"checkpoint {name} is for another optimizer: setting {differing[0]!r} of group {index} "
                "is in only one of them"
            )
        if list(here["params"]) != list(there["params"]):
            missing = sorted(set(here["params"]) ^ set(there["params"]))
            detail = f"{missing[0]} is in only one of them" if missing else "the parameters are in another order"
            raise CheckpointMismatchError(f"checkpoint {name} is for another optimizer: group {index}: {detail}")


def optimizer_state_dict(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tensors: Mapping[str, torch.Tensor],
    settings: Mapping[str, Any],
) -> dict[str, Any]:
    """The optimizer's own (positional) state dict built from saved tensors and settings, for `load_state_dict`."""
    names = parameter_names(model)
    by_param: dict[str, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith(OPTIM_PREFIX):
            param_name, state_name = key[len(OPTIM_PREFIX) :].rsplit("/", 1)
            by_param.setdefault(param_name, {})[state_name] = value
    for param_name, values in settings.get("values", {}).items():
        by_param.setdefault(param_name, {}).update(values)
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for live, saved in zip(optimizer.param_groups, settings["groups"]):
        ids = []
        for param in live["params"]:
            if names[id(param)] in by_param:
                state[index] = by_param[names[id(param)]]
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def model_keys(keys: Iterable[str]) -> list[str]:
    return [key for key in keys if key.startswith(MODEL_PREFIX)]


def _shape(shape: torch.Size) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"
