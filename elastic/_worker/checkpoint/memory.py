"""The memory tier, worker side: every step's state into node shared memory, and a copy on a peer node.

Under `torchrevive-run` each node runs a snapshot keeper (`elastic._agent.launcher.keeper`),
a part of the launcher that outlives the workers. It owns a directory in shared
memory (/dev/shm) and an HTTP endpoint for its peers, and tells the workers
where both are (`KeeperAddress`, from the environment). Each worker:

- writes its part of the state (its share of what a durable checkpoint holds,
  see parts.py) into that directory at every `every`-th step: `take` captures
  at the step boundary what the next step's forward pass may change, and the
  snapshot thread copies the rest (parameters, optimizer state) and publishes
  the part while the loop computes the next step (snapshot_write.py, phase by
  phase); the buffers it writes into are made once (snapshot_slots.py);
- sends the part to the keeper of one peer node (node i -> node i+1, a ring),
  on the same thread, so losing a whole node still leaves a copy;
- at restore, reports what its node holds (`inventory`), and reads the parts
  its node lacks from the keepers that hold them, only the rows it needs
  (`gather_files`, part_files.PartFiles).

Invariants:
- At most one snapshot is in flight per worker: the next one waits for the
  previous one's copy, checksums, header and replica, so every part a header
  names is whole and the replica is at most one snapshot behind.
- The optimizer step waits for the whole previous snapshot (copy, checksums,
  header, replica: `before_optimizer_step`): the parameters it changes were
  copied first, so a snapshot holds the state at its step's boundary, and a
  failure after it finds that snapshot whole. A finished step is redone only
  when a worker dies between the step's end and its snapshot's commit
  (snapshot_write.py), or when a node is lost before its replica is whole.
- What each snapshot costs the loop is measured (snapshot_costs.py) for
  `--snapshot-every auto` (snapshot_interval.py).
- Nothing here is on the restore's trust path: every request to a keeper is
  signed with the job's secret and every range read back carries the keeper's
  tag (keeper_client.py), and every chunk read is checked against its crc32c
  (chunks.read_rows), whatever its source.
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import struct
import time
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass
from pathlib import Path

import torch

from elastic._shared.storage import parts, sharded
from elastic._shared.storage.keeper_address import (
    LOCAL,
    PROGRESS,
    REPLICA,
    KeeperAddress,
    part_url,
)
from elastic._shared.storage.peer_auth import PeerKey
from elastic._worker.checkpoint import state as live_state
from elastic._worker.checkpoint.keeper_ring import KeeperSeen, peer_keeper, share_of_node
from elastic._worker.checkpoint.part_files import PartFiles
from elastic._worker.checkpoint.snapshot import BufferPool, DeferredCopy, copy_now
from elastic._worker.checkpoint.snapshot_costs import SnapshotCost, SnapshotCosts
from elastic._worker.checkpoint.snapshot_write import PUSH_TIMEOUT, Capture, PartWriter
from elastic._worker.checkpoint.training_state import TrainingState
from elastic._worker.checkpoint.writer import BackgroundWriter
from elastic._worker.control import agreement
from elastic._worker.runtime.context import WorkerContext
from elastic._worker.runtime.rng import get_rng_state

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Inventory(agreement.Message):
    """What one rank's node holds, gathered to rank 0 at restore."""

    node: str
    url: str
    progress: int | None
    """The newest step this node's workers finished (None: none noted)."""
    parts: list[list[str]]
    """[where ("local" | "replica"), the part's header as JSON] of every part of this run."""


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
        self._pool = BufferPool(pin_memory=False)  # the trainer state's and buffers' copies, reused
        self._copy: DeferredCopy | None = None  # the snapshot whose copy the next optimizer step waits for
        self.every = every
        self.writer_id = parts.new_writer_id()
        local = keeper.root / LOCAL
        local.mkdir(parents=True, exist_ok=True)
        self.part_writer = PartWriter(ctx, local, self.writer_id, key=key, ckpt_dir=ckpt_dir, keep=keep, fault=fault)
        self._writer = BackgroundWriter(name="snapshot-writer", drain_timeout=PUSH_TIMEOUT)
        self._step_ended = (-1, 0.0)  # (step, perf_counter) of the newest `note_step`
        self.disabled: str | None = None
        """Why snapshots stopped (shared memory full, say); None while they run."""
        self.costs = SnapshotCosts()
        """What each snapshot cost the loop (snapshot_costs.py)."""
        self._progress = self._open_progress()

    @property
    def generation(self) -> str:
        """The restore this worker resumed from (shared by every rank): a plan takes parts of one."""
        return self.part_writer.generation

    @generation.setter
    def generation(self, tag: str) -> None:
        """Set at the start of each restore, before any rank of the new generation snapshots; local
        rank 0 tells the keeper, which from then on keeps replicas of this generation only."""
        self.part_writer.generation = tag
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
        """The newest step this rank finished (read back after a failure: steps redone); its snapshot's
        exposure (snapshot_costs.SnapshotCost.exposed_seconds) is counted from here."""
        self._step_ended = (step, time.perf_counter())
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
        self.part_writer.peer = peer_keeper(self._ctx, KeeperSeen(self.keeper.node, self.keeper.url), group)
        if self.part_writer.peer is None and self._ctx.is_main and self._ctx.distributed:
            logger.info("snapshots stay on this node: the job runs on one node, so there is no peer to copy them to")

    # -- writing ---------------------------------------------------------------------

    def take(self, step: int) -> None:
        """Snapshot the state of `step` into this node's shared memory. Not a collective: each rank
        writes its own share. The loop copies only what the next step's forward pass may change
        (buffers) and the trainer state; the rest is copied on the snapshot thread before the next
        optimizer step (`before_optimizer_step`), then checksummed and published there."""
        began = time.perf_counter()
        self.wait_previous()  # at most one in flight: its slot, pool and thread are reused now
        waited = time.perf_counter() - began
        if self.disabled is not None:
            return
        state, ctx = self._state, self._ctx
        # What a weights-only load could not read back is refused at the first snapshot and at every
        # checkpoint (plain_state); checking it at every step would cost the loop for nothing.
        first = self.costs.taken == 0
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
        record = self.costs.begin(step)
        noted, ended = self._step_ended
        capture = Capture(step, now["trainer"], now["buffers"], build, self._copy, ended if noted == step else began)
        self._writer.submit(lambda: self._write(capture, record))
        blocked = time.perf_counter() - began
        record.capture_seconds = blocked - waited
        self.costs.blocked_seconds += blocked
        self.costs.capture_seconds += record.capture_seconds

    def before_optimizer_step(self) -> None:
        """Optimizer step pre-hook: the whole previous snapshot (copy, checksums, header, replica) is
        done, not only its copy: see the module docstring."""
        if self._copy is None:
            return
        started = time.perf_counter()
        self._copy.wait_sources_free()
        self._copy = None
        self._wait(at_step=True, started=started)

    def due(self, step: int) -> bool:
        return self.disabled is None and self.every > 0 and step % self.every == 0

    def wait_previous(self, *, charge: bool = True) -> None:
        """Loop thread: the previous snapshot is written and replicated (at most one in flight).
        `charge=False`: the wait is not counted in that snapshot's cost (a caller that counts the
        write's time itself: benchmarks/overhead.py charges it to the step it ends)."""
        self._wait(at_step=False, started=time.perf_counter() if charge else None)

    def _wait(self, *, at_step: bool, started: float | None) -> None:
        try:
            self._writer.wait()
        except Exception as exc:  # noqa: BLE001 - a snapshot bug must not stop training: say it, turn them off
            self._disable(f"a snapshot failed ({type(exc).__name__}: {exc})")
        waited = time.perf_counter() - started if started is not None else 0.0
        self.costs.waited(waited, finished=True, at_step=at_step)

    def _write(self, capture: Capture, record: SnapshotCost) -> None:
        """The snapshot thread's job: snapshot_write.PartWriter.write, and its cost noted."""
        try:
            written = self.part_writer.write(capture)
        except OSError as exc:  # a full /dev/shm, a failed mapping: degrade, never hang
            self._disable(f"cannot write the snapshot in {self.keeper.root} ({exc.strerror or exc})")
            return
        record.cpu_seconds, record.exposed_seconds = written.cpu_seconds, written.exposed_seconds
        record.replica_seconds = written.replica_cpu_seconds
        record.write_seconds, record.one_time = written.seconds, written.made_slot
        record.written = True

    def _disable(self, why: str) -> None:
        if self.disabled is None:
            self.disabled = why
            logger.warning("in-memory snapshots are off from now on: %s; checkpoints go to disk only", why)

    @property
    def allocations(self) -> int:
        """Buffers made so far, slots and the loop's copies: none after the first two snapshots while
        the state keeps its shapes (snapshot_slots.py)."""
        return self.part_writer.slots.created + self._pool.allocations

    @property
    def slot_bytes(self) -> int:
        """Bytes of this worker's largest snapshot slot (0: none written yet)."""
        return self.part_writer.slots.largest

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
