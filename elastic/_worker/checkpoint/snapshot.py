"""Copy a training state off the live model into CPU memory the writer owns.

The training loop may only block while the state is copied; serialising,
fsync and commit happen on the writer thread. Most of the copy is taken off
the loop too. Parameters and optimizer state change only inside
`optimizer.step()`, so building their state dicts and copying them runs on
the writer thread (a `DeferredCopy`) while the loop computes the next forward
and backward; a pre-hook on the optimizer step waits for it only if the loop
gets there first. What a forward pass or the loop itself changes (buffers such
as batch-norm statistics, sampler, scheduler, RNG) is copied at once, on the
loop's thread (`copy_now`).

Invariants:
- After `DeferredCopy.wait_sources_free()` returns, the live tensors may change:
  every byte the snapshot needs has been read from them (on CUDA: the device
  orders the next kernels after the copy; the host does not wait).
- After `DeferredCopy.materialize()` returns, its tree holds the state as it
  was when the loop asked for the save, in CPU tensors (pinned on CUDA) that
  nothing else writes until the next save.
- Tensors that share memory in the live state (tied weights) share one buffer.
- A DTensor (an FSDP2 shard) is copied as its local shard and comes back as a
  DTensor over the same mesh and placements: each rank holds only its shards.
- Buffers are reused from one save to the next: a steady-state save allocates
  nothing, so the copy runs at memory bandwidth, not page-fault speed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

Tree = Any
_TensorKey = tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...], int]


def _key(t: torch.Tensor) -> _TensorKey:
    return (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())


class BufferPool:
    """CPU tensors reused across saves, one per position in the state tree."""

    def __init__(self, pin_memory: bool) -> None:
        self._pin = pin_memory
        self._buffers: dict[str, torch.Tensor] = {}
        self.allocations = 0
        """Buffers allocated so far: none after the first save while the state keeps its shapes."""

    def get(self, path: str, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(path)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self._pin)
            self._buffers[path] = buf
            self.allocations += 1
        return buf

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def dtensor_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """`local` (a host buffer) as a shard of a DTensor sharded like `like`, where it is.

    Not `DTensor.from_local`: on a CUDA mesh that copies the local tensor to the
    GPU, so the DTensor would hold the buffer's contents of that moment (before
    the copy into it) on the GPU, instead of the buffer itself.
    """
    spec = like._spec
    if local.dtype != like.dtype:  # an optimizer moment kept in another dtype than its parameter
        spec = DTensorSpec(like.device_mesh, like.placements, tensor_meta=TensorMeta(like.shape, like.stride(), local.dtype))
    return DTensor(local, spec, requires_grad=False)


def plan_copies(
    tree: Tree, pool: BufferPool, prefix: str, keep: set[int] = frozenset()
) -> tuple[Tree, list[tuple[torch.Tensor, torch.Tensor]]]:
    """`tree` rebuilt with CPU buffers in place of tensors, and the (source, buffer) copies to make.

    Containers are rebuilt (later changes to live lists and dicts do not show);
    other leaves are immutable values and are shared; tensors whose id is in
    `keep` are already snapshot copies and stay as they are.
    """
    seen: dict[_TensorKey, torch.Tensor] = {}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def walk(node: Tree, path: str) -> Tree:
        if isinstance(node, DTensor):
            return dtensor_like(walk(node.to_local(), path), node)
        if isinstance(node, torch.Tensor):
            if id(node) in keep:
                return node
            key = _key(node)
            if key not in seen:
                seen[key] = pool.get(path, node)
                copies.append((node.detach(), seen[key]))
            return seen[key]
        if isinstance(node, dict):
            return {k: walk(v, f"{path}/{k}") for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v, f"{path}/{i}") for i, v in enumerate(node))
        return node

    return walk(tree, prefix), copies


def copy_now(tree: Tree, pool: BufferPool, device: torch.device, stream: torch.cuda.Stream | None = None) -> Tree:
    """Snapshot `tree` before returning (on CUDA: before the device runs anything queued later)."""
    cpu_tree, copies = plan_copies(tree, pool, "now")
    if device.type != "cuda":
        for source, buffer in copies:
            buffer.copy_(source)
        return cpu_tree
    current = torch.cuda.current_stream(device)
    stream = stream or torch.cuda.Stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        for source, buffer in copies:
            buffer.copy_(source, non_blocking=True)
    current.wait_stream(stream)  # device-side: later kernels wait for the copies
    stream.synchronize()  # small tensors; their values must be final before the writer reads them
    return cpu_tree


class DeferredCopy:
    """A part of the state built and copied on the writer thread (see module docstring).

    Created on the loop's thread at the moment of the save; `run` on the writer.
    """

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None = None) -> None:
        self._device = device
        self._stream = stream
        self._queued = threading.Event()  # CPU: copies done; CUDA: copies queued on the stream
        self._ready: torch.cuda.Event | None = None
        self._done: torch.cuda.Event | None = None
        self.tree: Tree = None
        if device.type == "cuda":
            # The values as of now: the copy stream waits for work the loop queued so far.
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(device))

    def run(self, build: Callable[[], Tree], pool: BufferPool, keep: set[int] = frozenset()) -> Tree:
        """Writer thread: build the live tree, copy it into `pool` buffers; returns the CPU tree."""

        def copies() -> list[tuple[torch.Tensor, torch.Tensor]]:
            self.tree, planned = plan_copies(build(), pool, "later", keep)
            return planned

        self.run_pairs(copies)
        return self.tree

    def run_pairs(self, build: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Writer thread: make the (live source, host buffer) copies `build` lists, where the buffers
        are the caller's own (an in-memory snapshot's slot views: no tree to rebuild)."""
        try:
            copies = build()
            if self._device.type == "cuda":
                stream = self._stream or torch.cuda.Stream(self._device)
                stream.wait_event(self._ready)
                with torch.cuda.stream(stream):
                    for source, buffer in copies:
                        buffer.copy_(source, non_blocking=True)
                    self._done = torch.cuda.Event()
                    self._done.record(stream)
            else:
                for source, buffer in copies:
                    buffer.copy_(source)
        finally:
            self._queued.set()  # on error too: never leave the loop waiting
        if self._done is not None:
            self._done.synchronize()

    def release(self) -> None:
        """Writer thread, on an error before `run_pairs`: the loop may go on (nothing will be copied)."""
        self._queued.set()

    def wait_sources_free(self) -> None:
        """Loop thread, before the optimizer step: block until the live tensors may change."""
        self._queued.wait()
        if self._done is not None:
            torch.cuda.current_stream(self._device).wait_event(self._done)

    @property
    def sources_free(self) -> bool:
        return self._queued.is_set()
