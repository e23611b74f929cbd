"""Replica checks: do all data-parallel ranks hold the same parameters?

Under DDP every rank must end each step with bit-identical parameters (under
FSDP2, its buffers and any parameter left unsharded; the shards differ by design). A
digest per rank, gathered on every rank, makes a silent divergence (a rank that
skipped a step, a non-deterministic reduction) visible at the end of a run.
"""

from __future__ import annotations

import hashlib

import torch
from torch.distributed.tensor import DTensor

from elastic._worker.control import agreement
from elastic._worker.runtime.context import WorkerContext


def parameter_digest(module: torch.nn.Module) -> str:
    """sha256 over every replicated parameter and buffer, in `state_dict` order, bit for bit.

    Sharded DTensors are skipped (each rank holds other shards), and so are the buffers of a
    sharded model: FSDP2, unlike DDP, does not keep them in step across ranks (a checkpoint
    saves rank 0's; SyncBatchNorm keeps batch statistics in step)."""
    digest = hashlib.sha256()
    sharded = any(isinstance(p, DTensor) for p in module.parameters())
    buffers = {name for name, _ in module.named_buffers()} if sharded else set()
    for name, tensor in module.state_dict().items():
        if isinstance(tensor, DTensor) or name in buffers or not isinstance(tensor, torch.Tensor):
            continue
        digest.update(name.encode())
        data = tensor.detach().to("cpu").contiguous()
        # View as bytes so the digest sees the exact bits, including for bf16.
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def gather_digests(ctx: WorkerContext, digest: str) -> list[str]:
    """Every rank's digest, indexed by rank (a collective: call it on all ranks)."""
    return [d.text for d in agreement.all_gather(ctx, agreement.Text(digest), agreement.Text)]
