"""The memory tier, worker side: every step's state into node shared memory, and a copy on a peer node.

Under `torchrevive-run` each node runs a snapshot keeper (`elastic._agent.launcher.keeper`),
a part of the launcher that outlives the workers. It owns a directory in shared
memory (/dev/shm) and an HTTP endpoint for its peers, and tells the workers
where both are (`KeeperAddress`, from the environment). Each worker:

- writes its part of the state (its share of what a durable checkpoint holds,
  see parts.py) into that directory at every `every`-th step, the loop blocking
  only while the state is copied (the copy of parameters and optimizer state
  runs off the loop until the next optimizer step, as for checkpoints);
- sends the part to the keeper of one peer node (node i -> node i+1, a ring),
  on the same background thread, so losing a whole node still leaves a copy;
- at restore, reports what its node holds (`inventory`), and reads the parts
  its node lacks from the keepers that hold them, only the rows it needs
  (`gather_files`, part_files.PartFiles).

Invariants:
- At most one snapshot is in flight per worker: the next one waits for the
  previous one's copy, checksums, header and replica, so every part a header
  names is whole and the replica is at most one snapshot behind.
- A snapshot's data file is allocated in full (fallocate) before it is mapped:
  a full /dev/shm is an error at allocation (snapshots turn off with a
  warning), never a SIGBUS in the middle of a copy.
- The optimizer step waits for the whole previous snapshot (copy, checksums,
  header, replica: `before_optimizer_step`): a step whose parameters change is
  finished, and a failure after it finds that step's snapshot whole, so at
  most one finished step is ever redone.
- Nothing here is on the restore's trust path: every request to a keeper is
  signed with the job's secret and every range read back carries the keeper's
  tag (keeper_client.py), and every chunk read is checked against its crc32c
  (chunks.read_rows), whatever its source.
"""

from __future__ import annotations

import http.client
import logging
import mmap
import os
import shutil
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from elastic._shared.storage import parts, sharded
from elastic._shared.storage.chunks import BLOCK, StoredChunk, block_checksums
from elastic._shared.storage.keeper_address import (
    LOCAL,
    PROGRESS,
    REPLICA,
    KeeperAddress,
    part_url,
)
from elastic._shared.storage.parts import PartHeader
from elastic._shared.storage.peer_auth import PeerKey
from elastic._worker.checkpoint import state as live_state
from elastic._worker.checkpoint.keeper_client import push_part
from elastic._worker.checkpoint.keeper_ring import KeeperSeen, peer_keeper, share_of_node
from elastic._worker.checkpoint.part_files import PartFiles
from elastic._worker.checkpoint.snapshot import BufferPool, DeferredCopy, copy_now
from elastic._worker.checkpoint.training_state import TrainingState
from elastic._worker.checkpoint.writer import BackgroundWriter
from elastic._worker.control import agreement
from elastic._worker.runtime.context import WorkerContext
from elastic._worker.runtime.rng import get_rng_state

logger = logging.getLogger(__name__)

PUSH_TIMEOUT = 30.0
PUSH_PAUSE = 30.0
"""Seconds without copies to the peer after one failed (a slow peer must not slow every step)."""


@dataclass(frozen=True)
class Inventory(agreement.Message):
    """What one rank's node holds, gathered to rank 0 at restore."""

    node: str
    url: str
    progress: int | None
    """The newest step this node's workers finished (None: none noted)."""
    parts: list[list[str]]
    """[where ("local" | "replica"), the part's header as JSON] of every part of this run."""


@dataclass(frozen=True)
class _Entry:
    key: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    global_size: tuple[int, ...]
    global_offset: tuple[int, ...]


def _local_and_global(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local data, global size, global offset of the local data) of a tensor or DTensor shard."""
    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import (
            compute_local_shape_and_global_offset,
        )

        _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tensor.to_local(), tuple(tensor.shape), tuple(int(o) for o in offset)
    return tensor, tuple(tensor.shape), (0,) * tensor.dim()


class _Slot:
    """One data file in shared memory, mapped, with a tensor view per key (layout fixed at creation)."""

    def __init__(self, path: Path, entries: list[_Entry], size: int) -> None:
        self.path = path
        self.entries = entries
        self.size = size
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, size)
            if size:
                os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS mid-copy
        finally:
            os.close(fd)
        self.data = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        self.views = {
            e.key: self.data[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in entries
        }
        self.signature = layout_signature(entries)

    def get(self, path: str, like: torch.Tensor) -> torch.Tensor:
        """The buffer for `path` ("later/<key>", as `snapshot.plan_copies` names it)."""
        return self.views[path.split("/", 1)[1]]


def layout_signature(entries: list[_Entry]) -> tuple[Any, ...]:
    """What a slot's mapping depends on: a slot is reused while this stays the same."""
    return tuple((e.key, e.dtype, e.shape) for e in entries)


def plan_layout(tensors: dict[str, torch.Tensor]) -> tuple[list[_Entry], int]:
    entries: list[_Entry] = []
    offset = 0
    for key in sorted(tensors):
        local, global_size, global_offset = _local_and_global(tensors[key])
        nbytes = local.numel() * local.element_size()
        entries.append(_Entry(key, offset, nbytes, local.dtype, tuple(local.shape), global_size, global_offset))
        offset += -(-nbytes // parts.ALIGN) * parts.ALIGN
    return entries, offset


class MemorySnapshots:
    """This worker's snapshots: write them, replicate them, and find them again after a failure."""

    def __init__(
        self,
        ctx: WorkerContext,
        keeper: KeeperAddress,
        state: TrainingState,
        *,
        key: PeerKey,
        every: int,
        ckpt_dir: str,
        keep: int,
        fault: Callable[[str, int], None] = lambda point, step: None,
        copy_stream: torch.cuda.Stream | None = None,
    ) -> None:
        self._ctx = ctx
        self.keeper = keeper
        self._key = key
        self._state = state
        self._copy_stream = copy_stream
        self._pool = BufferPool(pin_memory=False)
        self._copy: DeferredCopy | None = None  # the snapshot whose copy the next optimizer step waits for
        self.every = every
        self._ckpt_dir = ckpt_dir
        self._keep = keep
        self._fault = fault
        self.writer_id = parts.new_writer_id()
        self._local = keeper.root / LOCAL
        self._local.mkdir(parents=True, exist_ok=True)
        self._slots: list[_Slot | None] = [None, None]
        self._next_slot = 0
        self._writer = BackgroundWriter(name="snapshot-writer", drain_timeout=PUSH_TIMEOUT)
        self._peer: str | None = None
        self._push_warned = False
        self.disabled: str | None = None
        """Why snapshots stopped (shared memory full, say); None while they run."""
        self.history: list[dict[str, float]] = []
        """Per snapshot: step, seconds (copy to replica done)."""
        self.blocking_seconds: list[float] = []
        """Per snapshot: seconds the loop was blocked taking it (the optimizer step's wait not included)."""
        self.step_wait_seconds: list[float] = []
        """Per snapshot: seconds the next optimizer step waited for it to be written and replicated."""
        self.copy_seconds: list[float] = []
        """Per snapshot: `blocking_seconds` less its wait for the previous one: the loop's own part of the copy."""
        self._generation = ""
        self._push_paused_until = 0.0
        self._progress = self._open_progress()

    @property
    def generation(self) -> str:
        """The restore this worker resumed from (shared by every rank): a plan takes parts of one."""
        return self._generation

    @generation.setter
    def generation(self, tag: str) -> None:
        """Set at the start of each restore, before any rank of the new generation snapshots; local
        rank 0 tells the keeper, which from then on keeps replicas of this generation only."""
        self._generation = tag
        if self._ctx.local_rank == 0:
            try:
                self.keeper.note_job(self._ctx.run_id, tag, self._ctx.world_size)
            except OSError as exc:
                logger.warning("cannot tell the snapshot keeper this job's generation (%s): "
                               "its peer's copies will be refused", exc.strerror or exc)

    # -- progress ------------------------------------------------------------------

    def _open_progress(self) -> mmap.mmap | None:
        directory = self.keeper.root / PROGRESS
        try:
            directory.mkdir(exist_ok=True)
            path = directory / f"rank_{self._ctx.rank:05d}"
            with open(path, "a+b") as f:
                f.truncate(8)
                return mmap.mmap(f.fileno(), 8)
        except OSError:
            return None

    def note_step(self, step: int) -> None:
        """The newest step this rank finished (read back after a failure: steps redone)."""
        if self._progress is not None:
            struct.pack_into("<q", self._progress, 0, step)

    def reset_progress(self, step: int) -> None:
        """After a restore: this rank's progress is `step`, and the node forgets ranks it no longer
        runs (their notes would count at the next failure). Local rank 0 does the forgetting."""
        self.note_step(step)
        if self._ctx.local_rank != 0:
            return
        first = self._ctx.rank - self._ctx.local_rank
        mine = {f"rank_{r:05d}" for r in range(first, first + self._ctx.local_world_size)}
        for path in (self.keeper.root / PROGRESS).glob("rank_*"):
            if path.name not in mine:
                path.unlink(missing_ok=True)

    def last_progress(self) -> int | None:
        """The newest step any worker of this node noted (before this restart)."""
        newest = None
        for path in (self.keeper.root / PROGRESS).glob("rank_*"):
            try:
                raw = path.read_bytes()
            except OSError:
                continue
            if len(raw) == 8:
                step = struct.unpack("<q", raw)[0]
                newest = step if newest is None else max(newest, step)
        return newest

    # -- peers ---------------------------------------------------------------------

    def connect(self, group: Any = agreement.DEFAULT_GROUP) -> None:
        """A collective: pick this node's peer, the next node's keeper in a ring (keeper_ring)."""
        self._peer = peer_keeper(self._ctx, KeeperSeen(self.keeper.node, self.keeper.url), group)
        if self._peer is None and self._ctx.is_main and self._ctx.distributed:
            logger.info("snapshots stay on this node: the job runs on one node, so there is no peer to copy them to")

    # -- writing ---------------------------------------------------------------------

    def take(self, step: int) -> None:
        """Copy the state of `step` into this node's shared memory. Not a collective: each rank
        copies its own share; the loop blocks only for the buffers and trainer state, the rest is
        copied on the snapshot thread before the next optimizer step (`before_optimizer_step`)."""
        started = time.perf_counter()
        self.wait_previous()  # at most one in flight: its buffers are reused now
        waited = time.perf_counter() - started
        if self.disabled is not None:
            return
        state, ctx = self._state, self._ctx
        # What a weights-only load could not read back is refused at the first snapshot and at every
        # checkpoint (plain_state); checking it at every step would cost the loop for nothing.
        first = not self.history
        trainer = state.trainer_state(
            step, ctx.world_size, [get_rng_state(ctx.device)], state.extra_state(check=first),
            state.optimizer_settings(check=first), check=first,
        )
        layout = state.layout
        if layout.sharded:
            # FSDP2 swaps its registered parameters in every forward: the share is taken now.
            mine = layout.share(layout.tensors(), ctx.rank, ctx.world_size)
            buffers = {k: v for k, v in mine.items() if k in layout.buffer_keys}

            def build() -> dict[str, torch.Tensor]:
                return mine
        else:
            # Every buffer is copied now (a forward changes them; they are small); which of them
            # and of the parameters this rank keeps is settled on the snapshot thread.
            buffers = {live_state.MODEL_PREFIX + name: b for name, b in state.model.named_buffers()}

            def build() -> dict[str, torch.Tensor]:
                return layout.share(layout.tensors(), ctx.rank, ctx.world_size)
        now = copy_now({"trainer": trainer, "buffers": buffers}, self._pool, ctx.device, self._copy_stream)
        self._copy = DeferredCopy(ctx.device, self._copy_stream)
        self.submit(step, now["trainer"], now["buffers"], build, self._copy)
        self.blocking_seconds.append(time.perf_counter() - started)
        self.copy_seconds.append(self.blocking_seconds[-1] - waited)

    def before_optimizer_step(self) -> None:
        """Optimizer step pre-hook: the whole previous snapshot (copy, checksums, header, replica) is
        done, not only its copy: see the module docstring."""
        if self._copy is None:
            return
        started = time.perf_counter()
        self._copy.wait_sources_free()
        self._copy = None
        self.wait_previous()
        self.step_wait_seconds.append(time.perf_counter() - started)

    def due(self, step: int) -> bool:
        return self.disabled is None and self.every > 0 and step % self.every == 0

    def costs(self, first: int = 0) -> list[float]:
        """Each finished snapshot's cost to the loop from the `first`-th on: its copy on the loop plus
        its writer's time (on a busy host the writer competes with the step for the cores)."""
        done = len(self.history)  # appended last by the writer: the copy of the same index exists
        return [self.copy_seconds[i] + self.history[i]["seconds"] for i in range(first, done)]

    def wait_previous(self) -> None:
        """Loop thread: the previous snapshot is written and replicated (at most one in flight)."""
        try:
            self._writer.wait()
        except Exception as exc:  # noqa: BLE001 - a snapshot bug must not stop training: say it, turn them off
            self._disable(f"a snapshot failed ({type(exc).__name__}: {exc})")

    def submit(
        self,
        step: int,
        trainer: dict[str, Any],
        buffers: dict[str, torch.Tensor],
        build: Callable[[], dict[str, torch.Tensor]],
        deferred: DeferredCopy,
    ) -> None:
        """Write the snapshot of `step` on the snapshot thread: `build()` gives this rank's live
        share, whose parameters and optimizer state `deferred` copies there; its buffers come
        from `buffers` (copies already, of at least the share's buffers), as does `trainer`."""
        self._writer.submit(lambda: self._write(step, trainer, buffers, build, deferred))

    def _disable(self, why: str) -> None:
        if self.disabled is None:
            self.disabled = why
            logger.warning("in-memory snapshots are off from now on: %s; checkpoints go to disk only", why)

    def _slot_for(self, tensors: dict[str, torch.Tensor]) -> tuple[int, _Slot]:
        """The slot to write next and its index, its header gone (so no reader trusts it while it changes)."""
        index = self._next_slot
        self._next_slot = 1 - index
        entries, size = plan_layout(tensors)
        signature = layout_signature(entries)
        stem = parts.part_stem(self._ctx.rank, self.writer_id, index)
        (self._local / (stem + parts.HEADER_SUFFIX)).unlink(missing_ok=True)
        slot = self._slots[index]
        if slot is None or slot.signature != signature:
            self._slots[index] = None  # unmap the old layout first
            slot = _Slot(self._local / (stem + parts.DATA_SUFFIX), entries, size)
            self._slots[index] = slot
        return index, slot

    def _write(
        self,
        step: int,
        trainer: dict[str, Any],
        buffers: dict[str, torch.Tensor],
        build: Callable[[], dict[str, torch.Tensor]],
        deferred: DeferredCopy,
    ) -> None:
        started = time.perf_counter()
        if self._ctx.device.type == "cuda":
            torch.cuda.set_device(self._ctx.device)
        try:
            share = build()
            live = {k: v for k, v in share.items() if k not in buffers}
            tensors = {k: buffers.get(k, v) for k, v in share.items()}
            index, slot = self._slot_for(tensors)
        except Exception as exc:  # noqa: BLE001 - full /dev/shm (OSError), a failed mapping: degrade, never hang
            deferred.run(lambda: {}, None)  # release the optimizer step
            what = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
            self._disable(f"cannot allocate the snapshot in {self.keeper.root} ({what})")
            return
        deferred.run(lambda: live, slot)
        for key in tensors.keys() - live.keys():
            slot.views[key].copy_(sharded.local_part(buffers[key]))
        self._fault("during_snapshot", step)
        data = memoryview(slot.data.numpy()) if slot.size else memoryview(b"")
        chunks, shapes = [], {}
        for entry in slot.entries:
            piece = data[entry.offset : entry.offset + entry.nbytes]
            stored = StoredChunk(
                parts.part_stem(self._ctx.rank, self.writer_id, index) + parts.DATA_SUFFIX,
                entry.offset, entry.nbytes, str(entry.dtype), entry.shape,
                tuple(block_checksums(piece, BLOCK)), BLOCK,
            )
            chunks.append({"fqn": entry.key, "at": list(entry.global_offset), **stored.to_json()})
            shapes[entry.key] = {"dtype": str(entry.dtype), "size": list(entry.global_size)}
        blob, blob_crc = parts.encode_trainer(trainer)
        header = PartHeader(
            run_id=self._ctx.run_id, step=step, rank=self._ctx.rank, world_size=self._ctx.world_size,
            writer=self.writer_id, slot=index, data_bytes=slot.size, chunks=chunks, tensors=shapes,
            trainer=blob, trainer_crc32c=blob_crc, ckpt_dir=self._ckpt_dir, keep=self._keep, created=time.time(),
            extra={"generation": self.generation},
        )
        parts.write_header(self._local, header)
        if self._peer is not None and time.monotonic() >= self._push_paused_until:
            self._push(header, data)
        self.history.append({"step": step, "seconds": time.perf_counter() - started})

    def _push(self, header: PartHeader, data: memoryview) -> None:
        """Send the part to the peer's keeper; a failure is one warning (the local copy stands)."""
        assert self._peer is not None
        try:
            push_part(self._peer, self._key, header.stem, header.to_json(), data, PUSH_TIMEOUT)
        except (OSError, http.client.HTTPException) as exc:
            # A peer that does not answer must not hold every step: no copies for a while.
            self._push_paused_until = time.monotonic() + PUSH_PAUSE
            if not self._push_warned:
                self._push_warned = True
                logger.warning("cannot copy the snapshot to the peer node's keeper at %s (%s); "
                               "a loss of this node would restore from disk", self._peer, exc)
            return
        self._push_warned = False

    # -- finding them again ------------------------------------------------------------

    def inventory(self) -> Inventory:
        """What this node holds: its keeper, the newest step its workers finished, and this rank's share
        of the parts of this run (keeper_ring.share_of_node: the node's ranks report each part once)."""
        held, ranks = [], []
        for where in (LOCAL, REPLICA):
            for header in parts.read_headers(self.keeper.root / where):
                if header.run_id == self._ctx.run_id:
                    held.append([where, header.to_json().decode()])
                    ranks.append(header.rank)
        return Inventory(self.keeper.node, self.keeper.url, self.last_progress(), share_of_node(self._ctx, held, ranks))

    def gather_files(
        self, locations: dict[int, list[list[str]]], tag: str, *, fetch_deadline: float | None = None
    ) -> PartFiles:
        """The parts of a restore, as this rank reads them: a directory where `shard_file(r)` is
        old rank r's part data when this node holds it (a symlink to it), and the keepers to
        ask for the rows of the others (`PartFiles`, read only where this rank's plan reads).

        `locations`: old rank -> [[node, keeper url, where, stem]], this node's first when it has one.
        `fetch_deadline` (time.monotonic): no request to another keeper starts or waits past it.
        """
        directory = self.restore_directory(tag)
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        remote: dict[str, list[str]] = {}
        for old_rank, places in locations.items():
            here = [p for p in places if p[0] == self.keeper.node]
            if here:
                _, _, where, stem = here[0]
                os.symlink(self.keeper.root / where / (stem + parts.DATA_SUFFIX), directory / sharded.shard_file(old_rank))
            else:
                remote[sharded.shard_file(old_rank)] = [
                    part_url(url, where, stem + parts.DATA_SUFFIX) for _, url, where, stem in places
                ]
        return PartFiles(directory, remote, key=self._key, deadline=fetch_deadline)

    def restore_directory(self, tag: str) -> Path:
        """Where `gather_files` lays out this rank's parts for the restore `tag`."""
        return self.keeper.root / f"restore-{tag}-{self._ctx.rank:05d}"

    def close(self, timeout: float = PUSH_TIMEOUT) -> None:
        try:
            self._writer.close(timeout=min(timeout, PUSH_TIMEOUT))
        except Exception as exc:  # noqa: BLE001 - closing: a late snapshot failure is only logged
            logger.debug("snapshot writer: %s", exc)
        if self._progress is not None:
            self._progress.close()
            self._progress = None
