"""Many tensors of one source rank sent to every rank in a few broadcasts, not one each.

A model's training state is some hundreds of tensors (a parameter and its
optimizer state each), most of them small; one broadcast per tensor costs a
round trip each, 0.1 s for the GPT recipe's state on gloo. Here tensors of one
dtype and one device travel packed in flat buffers of at most `BUCKET_BYTES`
(a larger tensor alone).

Invariants:
- Every rank passes the same sequence of (shape, dtype, device) in the same
  order (they come from the same checked header or checkpoint metadata), so
  every rank cuts the same buckets and takes part in the same broadcasts.
- The receivers' tensors are written in place, each with its own storage (a
  view into the flat buffer would keep the whole buffer alive, and a
  `torch.save` of it would write the whole buffer); the source's are only read.
- Packing costs one copy of a bucket in memory, at most `BUCKET_BYTES` more.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

BUCKET_BYTES = 64 << 20
"""At most this many bytes of consecutive tensors of one dtype travel in one broadcast."""


def buckets(tensors: list[torch.Tensor]) -> list[list[int]]:
    """The positions of `tensors` in order, cut into runs of one dtype and device of at most
    `BUCKET_BYTES` (or one tensor)."""
    cut: list[list[int]] = []
    size = 0
    kind = None
    for index, tensor in enumerate(tensors):
        nbytes = tensor.numel() * tensor.element_size()
        this = (tensor.dtype, tensor.device)
        if not cut or this != kind or size + nbytes > BUCKET_BYTES:
            cut.append([])
            size, kind = 0, this
        cut[-1].append(index)
        size += nbytes
    return cut


def broadcast(tensors: list[torch.Tensor], source: int, *, rank: int, group: dist.ProcessGroup | None = None) -> None:
    """`source`'s `tensors` into every rank's `tensors` of the same shapes and dtypes (a collective
    of `group`; CUDA tensors travel on the default group, on the device). `rank`: this rank."""
    for bucket in buckets(tensors):
        members = [tensors[i] for i in bucket]
        on_device = members[0].device.type == "cuda"
        if len(members) == 1 and members[0].is_contiguous():  # nothing to pack
            dist.broadcast(members[0], source, group=None if on_device else group)
            continue
        if rank == source:
            flat = torch.cat([t.detach().reshape(-1) for t in members])
        else:
            flat = torch.empty(sum(t.numel() for t in members), dtype=members[0].dtype, device=members[0].device)
        dist.broadcast(flat, source, group=None if on_device else group)
        if rank == source:
            continue
        offset = 0
        for tensor in members:
            tensor.copy_(flat[offset:offset + tensor.numel()].view(tensor.shape))
            offset += tensor.numel()
