"""The shared-memory slots a worker writes its in-memory snapshots into: made once, reused at every snapshot.

A worker has two slots (parts.py's `s0` and `s1`), written in turn. A slot is one
data file in the keeper's `local/` directory, allocated in full and mapped once,
with a view per tensor of the rank's share at a fixed, aligned offset (`Layout`),
and what its part header says of each chunk apart from the checksums (place,
dtype, sizes; each tensor's global shape) worked out once with it.

Invariants:
- A slot's data file is allocated in full (fallocate) before it is mapped: a full
  /dev/shm is an `OSError` here, never a SIGBUS in the middle of a copy.
- While the share keeps its keys, dtypes and shapes (`signature_of`), a slot is
  reused as it is: a steady-state snapshot creates no file, maps nothing and
  allocates no buffer (`SlotPair.created` counts the slots made).
- `SlotPair.next` removes the chosen slot's header before it returns the slot:
  from then until a new header is published, no reader trusts its data, while
  the other slot, untouched, holds the newest complete snapshot.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from elastic._shared.storage import parts


@dataclass(frozen=True)
class Entry:
    """One tensor's place in a slot, and where its data lies in the global tensor."""

    key: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    global_size: tuple[int, ...]
    global_offset: tuple[int, ...]


def local_and_global(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local data, global size, global offset of the local data) of a tensor or DTensor shard."""
    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import (
            compute_local_shape_and_global_offset,
        )

        _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tensor.to_local(), tuple(tensor.shape), tuple(int(o) for o in offset)
    return tensor, tuple(tensor.shape), (0,) * tensor.dim()


def signature_of(tensors: Mapping[str, torch.Tensor]) -> tuple[Any, ...]:
    """What a slot's layout depends on: every key with its dtype, global shape and local shape, in the
    mapping's order (a share's order is its state dict's: the same at every snapshot; another order
    only makes a new layout)."""
    return tuple(
        (key, t.dtype, t.shape, t.to_local().shape if isinstance(t, DTensor) else None) for key, t in tensors.items()
    )


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a share lies in a slot (in key order, each at a multiple of `parts.ALIGN`)."""

    entries: tuple[Entry, ...]
    size: int
    signature: tuple[Any, ...]

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> Layout:
        entries: list[Entry] = []
        offset = 0
        for key in sorted(tensors):
            local, global_size, global_offset = local_and_global(tensors[key])
            nbytes = local.numel() * local.element_size()
            entries.append(Entry(key, offset, nbytes, local.dtype, tuple(local.shape), global_size, global_offset))
            offset += -(-nbytes // parts.ALIGN) * parts.ALIGN
        return cls(tuple(entries), offset, signature_of(tensors))

    def tensors(self) -> dict[str, dict[str, Any]]:
        """The part header's `tensors`: each tensor's global dtype and size."""
        return {e.key: {"dtype": str(e.dtype), "size": list(e.global_size)} for e in self.entries}


class Slot:
    """One data file in shared memory, mapped, with a view per tensor (its layout fixed at creation)."""

    def __init__(self, path: Path, index: int, layout: Layout, block: int) -> None:
        self.path = path
        self.index = index
        self.layout = layout
        size = layout.size
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, size)
            if size:
                os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS mid-copy
        finally:
            os.close(fd)
        self.data = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        self.views = {
            e.key: self.data[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in layout.entries
        }
        self.bytes = memoryview(self.data.numpy()) if size else memoryview(b"")
        """The whole data file, for checksums and the replica (the same mapping as `views`)."""
        self.pieces = [self.bytes[e.offset : e.offset + e.nbytes] for e in layout.entries]
        """Each entry's bytes, in the order of `layout.entries`."""
        # Each chunk record's JSON up to its checksums, rendered once: a header is then made by joining
        # strings (a header of thousands of tensors is megabytes of JSON, rendered at every step).
        self._chunk_heads = [
            json.dumps({"fqn": e.key, "at": list(e.global_offset), "file": path.name, "offset": e.offset,
                        "length": e.nbytes, "dtype": str(e.dtype), "sizes": list(e.shape), "block": block})[:-1]
            + ', "crc32c": ['
            for e in layout.entries
        ]
        self.tensors_json = json.dumps(layout.tensors())
        """The part header's `tensors`, rendered once."""

    def render_chunks(self, checksums: list[tuple[int, ...]]) -> str:
        """The part header's `chunks` (StoredChunk records with `fqn` and `at`) with these checksums, as a
        JSON array (parts.PartHeader.to_json's `chunks_json`)."""
        return "[" + ", ".join(
            head + ", ".join(map(str, crcs)) + "]}" for head, crcs in zip(self._chunk_heads, checksums, strict=True)
        ) + "]"


class SlotPair:
    """A worker's two slots, taken in turn (see the module docstring)."""

    def __init__(self, directory: Path, stem_of: Callable[[int], str], block: int) -> None:
        self._directory = directory
        self._stem_of = stem_of
        self._block = block
        self._slots: list[Slot | None] = [None, None]
        self._next = 0
        self.created = 0
        """Slots made (files allocated and mapped) so far: two in a steady run, more only when the share changed."""

    def next(self, tensors: Mapping[str, torch.Tensor]) -> Slot:
        """The slot to write the snapshot of `tensors` into, its header removed; an `OSError` when its
        file cannot be allocated (the other slot is then the next one asked for)."""
        index = self._next
        self._next = 1 - index
        stem = self._stem_of(index)
        (self._directory / (stem + parts.HEADER_SUFFIX)).unlink(missing_ok=True)
        slot = self._slots[index]
        signature = signature_of(tensors)
        if slot is not None and slot.layout.signature == signature:
            return slot
        self._slots[index] = None  # unmap the old layout first
        other = self._slots[1 - index]
        layout = other.layout if other is not None and other.layout.signature == signature else Layout.of(tensors)
        slot = Slot(self._directory / (stem + parts.DATA_SUFFIX), index, layout, self._block)
        self._slots[index] = slot
        self.created += 1
        return slot

    @property
    def made(self) -> list[Slot]:
        """The slots made so far (at most two)."""
        return [s for s in self._slots if s is not None]

    @property
    def largest(self) -> int:
        """Bytes of the largest slot made (0: none yet)."""
        return max((s.layout.size for s in self.made), default=0)
