"""Wrapping a model for the job: DDP or FSDP2 over every rank, and back to the module whose state is saved.

Invariants:
- Alone (one process, no group) a model is returned as it is: the same script
  runs under `python` and under torchrun.
- `unwrap` finds the module under DDP and torch.compile wrappers; wrappers whose
  state cannot be checkpointed correctly (FSDP1) are one `UsageError` line.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from elastic._shared.common.errors import UsageError
from elastic._worker.runtime.context import WorkerContext


def ddp(ctx: WorkerContext, model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
    """`model` under DistributedDataParallel in a job of several processes, as is alone."""
    if not ctx.distributed:
        return model
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, **kwargs)


def fsdp(
    ctx: WorkerContext,
    model: torch.nn.Module,
    *,
    blocks: Iterable[torch.nn.Module] = (),
    mixed_precision: bool | None = None,
) -> torch.nn.Module:
    """`model` sharded with FSDP2 (`fully_shard`) over every rank: each of `blocks`
    (the transformer layers), then the model itself. Parameters, gradients and
    optimizer state are split across ranks, and checkpoints save each rank's
    shards and reshard on restore at another world size. Build the optimizer
    after this call. `mixed_precision` (default: on CUDA) computes in bf16 and
    reduces gradients in fp32. Alone, the model is returned as is.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not ctx.distributed:
        return model
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    if mixed_precision is None:
        mixed_precision = ctx.device.type == "cuda"
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision else MixedPrecisionPolicy()
    )
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose state is saved: under DDP and torch.compile wrappers.

    Wrappers whose state the runtime cannot save correctly are refused in one line.
    """
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
            model = model._orig_mod
        else:
            break
    if type(model).__name__ == "FullyShardedDataParallel":
        raise UsageError(
            "FSDP1 (FullyShardedDataParallel) models cannot be checkpointed here: its state dict is a collective; "
            "use FSDP2 (run.fsdp(model), torch.distributed.fsdp.fully_shard)"
        )
    return model
