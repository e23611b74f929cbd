"""Copy a training state off the live model into CPU memory the writer owns.

The training loop may only block while the state is copied; everything after
(serialising, fsync, commit) happens on the writer thread. Even the copy is
mostly taken off the loop: parameters and optimizer state change only inside
`optimizer.step()`, so their copy ("deferred") runs on the writer thread
while the loop computes the next forward and backward, and the loop waits for
it only if it reaches the next `optimizer.step()` first. Everything else
("immediate": buffers such as batch-norm statistics, which a forward pass
changes, and small plain values) is copied before `capture` returns.

Invariants:
- After `Snapshot.wait_sources_free()` returns, the live tensors may change:
  every byte the snapshot needs has been read from them.
- After `Snapshot.materialize()` returns, `Snapshot.tree` holds the state as
  it was at `capture`, in CPU tensors (pinned on CUDA) that nothing else writes
  until the next capture.
- Tensors that share memory in the live state (tied weights) share one buffer.
- Buffers are reused from one capture to the next: a steady-state save
  allocates nothing, so the copy runs at memory bandwidth, not page-fault speed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

Tree = Any
_TensorKey = tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...], int]


def _key(t: torch.Tensor) -> _TensorKey:
    return (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())


class BufferPool:
    """CPU tensors reused across captures, one per position in the state tree."""

    def __init__(self, pin_memory: bool) -> None:
        self._pin = pin_memory
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, path: str, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(path)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self._pin)
            self._buffers[path] = buf
        return buf

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class Snapshot:
    """One capture of a state tree; see the module docstring for its life cycle."""

    def __init__(self, tree: Tree, copies: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> None:
        self.tree = tree
        self._copies = copies  # (source, cpu buffer) pairs still to copy
        self._device = device
        self._sources_free = threading.Event()
        self._cuda_done: torch.cuda.Event | None = None
        if not copies:
            self._sources_free.set()

    # -- writer side -----------------------------------------------------------

    def materialize(self) -> None:
        """Fill the deferred buffers (on the writer thread) and wait until they hold the data."""
        if self._device.type == "cuda":
            # Already queued on a side stream by `capture`; wait for the bytes to land.
            if self._cuda_done is not None:
                self._cuda_done.synchronize()
            return
        try:
            for source, buffer in self._copies:
                buffer.copy_(source)
        finally:
            self._copies = []
            self._sources_free.set()

    # -- loop side -------------------------------------------------------------

    def wait_sources_free(self) -> None:
        """Block until the live tensors may be modified (the optimizer step hook calls this)."""
        if self._device.type == "cuda":
            if self._cuda_done is not None:
                # Device-side ordering only: the host does not wait.
                torch.cuda.current_stream(self._device).wait_event(self._cuda_done)
            return
        self._sources_free.wait()

    @property
    def sources_free(self) -> bool:
        return self._device.type == "cuda" or self._sources_free.is_set()


def capture(
    tree: Tree,
    *,
    pool: BufferPool,
    deferred: Callable[[torch.Tensor], bool],
    device: torch.device,
    copy_stream: torch.cuda.Stream | None = None,
) -> Snapshot:
    """Rebuild `tree` with CPU buffers in place of tensors and copy what must be copied now.

    Containers are rebuilt (so later changes to the live lists and dicts do not
    show), leaves that are not tensors are immutable values and are shared.
    """
    seen: dict[_TensorKey, torch.Tensor] = {}
    immediate: list[tuple[torch.Tensor, torch.Tensor]] = []
    later: list[tuple[torch.Tensor, torch.Tensor]] = []

    def walk(node: Tree, path: str) -> Tree:
        if isinstance(node, torch.Tensor):
            source = node.detach()
            key = _key(source)
            if key in seen:
                return seen[key]
            buffer = pool.get(path, source)
            seen[key] = buffer
            (later if deferred(source) else immediate).append((source, buffer))
            return buffer
        if isinstance(node, dict):
            return {k: walk(v, f"{path}/{k}") for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v, f"{path}/{i}") for i, v in enumerate(node))
        return node

    cpu_tree = walk(tree, "")
    if device.type == "cuda":
        return _capture_cuda(cpu_tree, immediate, later, device, copy_stream)
    for source, buffer in immediate:
        buffer.copy_(source)
    return Snapshot(cpu_tree, later, device)


def _capture_cuda(
    cpu_tree: Tree,
    immediate: list[tuple[torch.Tensor, torch.Tensor]],
    later: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    copy_stream: torch.cuda.Stream | None,
) -> Snapshot:
    """Queue every copy on a side stream; the host blocks for none of them."""
    stream = copy_stream or torch.cuda.Stream(device)
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)  # copy the values as of now, after queued work
    with torch.cuda.stream(stream):
        for source, buffer in immediate:
            buffer.copy_(source, non_blocking=True)
        immediate_done = torch.cuda.Event()
        immediate_done.record(stream)
        for source, buffer in later:
            buffer.copy_(source, non_blocking=True)
        all_done = torch.cuda.Event()
        all_done.record(stream)
    # Tensors a forward pass changes must not change before their copy is read.
    current.wait_event(immediate_done)
    snapshot = Snapshot(cpu_tree, [], device)
    snapshot._cuda_done = all_done
    return snapshot
