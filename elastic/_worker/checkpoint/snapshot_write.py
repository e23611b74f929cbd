"""One in-memory snapshot, written on the snapshot thread while the loop computes the next step.

`MemorySnapshots.take` (memory.py) captures at the step boundary what the next
step's forward pass or the loop may change (buffers; the trainer state: sampler,
scheduler, RNG, extra state) and hands it over with a `DeferredCopy` of the rest.
`PartWriter.write` then runs these phases, each ending at a named fault point:

  1. the slot not holding the newest complete snapshot is taken and its header
     removed (snapshot_slots.SlotPair.next)                       "snapshot_begun"
  2. the parameters and optimizer state are copied into it (the next optimizer
     step waits for this copy: `DeferredCopy`), then the buffers   "during_snapshot"
  3. every chunk is checksummed (crc32c per block)                 "snapshot_checksummed"
  4. the header is published (temporary file, rename): the commit "snapshot_committed"
  5. the part is copied to the peer node's keeper (a replica).

Invariants:
- A kill at any moment leaves the newest complete snapshot before this one
  whole and usable: this one writes only into the other slot, whose header it
  removed first, and its header, published last and atomically, is the only
  thing that makes its data trusted. A reader checks every chunk against the
  header's checksums, so a header with data changed under it is never used
  either (parts.py). Between the step's end and phase 4 a kill restores the
  step before: that interval (`Written.exposed_seconds`) is the only way one
  finished step is redone after a worker's death.
- The state written is the state at the step boundary: what `take` captured
  was copied before it returned, and the rest changes only in the optimizer
  step, which waits for phase 2's copy (memory.py's `before_optimizer_step`).
- The header's JSON is made once: the same bytes are written and sent.
- `Written.cpu_seconds` is every CPU second this thread and the checksum pool
  spent on the snapshot up to its commit, `replica_cpu_seconds` those its
  copy to the peer took (not the peer keeper's): on a host with no idle core
  those seconds are taken from the loop, so the interval's budgets count them
  (snapshot_interval.py). With more than one intra-op thread a CPU copy's
  other threads are not counted (workers run one).
"""

from __future__ import annotations

import http.client
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elastic._shared.storage import parts, sharded
from elastic._shared.storage.chunks import BLOCK, pieces_checksums
from elastic._shared.storage.parts import PartHeader
from elastic._shared.storage.peer_auth import PeerKey
from elastic._worker.checkpoint.keeper_client import push_part
from elastic._worker.checkpoint.snapshot import DeferredCopy
from elastic._worker.checkpoint.snapshot_slots import SlotPair
from elastic._worker.runtime.context import WorkerContext
from elastic._worker.timings import PUSH_PAUSE, PUSH_TIMEOUT

logger = logging.getLogger(__name__)

BEGUN, COPIED, CHECKSUMMED, COMMITTED = "snapshot_begun", "during_snapshot", "snapshot_checksummed", "snapshot_committed"
PHASES = (BEGUN, COPIED, CHECKSUMMED, COMMITTED)
"""The fault points of a snapshot's write, in order (elastic._shared.protocol.fault_hook.POINTS)."""


@dataclass
class Capture:
    """What the loop hands the snapshot thread at the step boundary."""

    step: int
    trainer: dict[str, Any]
    """The trainer state, copied already."""
    buffers: dict[str, torch.Tensor]
    """Copies of the model's buffers (of at least the share's)."""
    build: Callable[[], dict[str, torch.Tensor]]
    """This rank's live share: its parameters and optimizer state are copied by `deferred`."""
    deferred: DeferredCopy
    began: float
    """`time.perf_counter()` when the loop began the snapshot (the step had ended)."""


@dataclass(frozen=True)
class Written:
    step: int
    cpu_seconds: float
    """CPU seconds the write took up to its commit (see the module docstring)."""
    replica_cpu_seconds: float
    """CPU seconds its copy to the peer node's keeper took (0: none was sent)."""
    exposed_seconds: float
    """From the step's end to the commit: a kill then restores the step before."""
    seconds: float
    """Wall seconds of the write on the snapshot thread, replica included."""
    made_slot: bool
    """It made its slot (a file allocated and mapped, its pages touched first): a one-time cost."""


class PartWriter:
    """Writes a worker's snapshot parts into its node's keeper directory, and copies them to the peer's."""

    def __init__(
        self, ctx: WorkerContext, directory: Path, writer_id: str, *, key: PeerKey, ckpt_dir: str, keep: int,
        fault: Callable[[str, int], None],
    ) -> None:
        self._ctx = ctx
        self._directory = directory
        self._writer_id = writer_id
        self._key = key
        self._ckpt_dir = ckpt_dir
        self._keep = keep
        self._fault = fault
        self.slots = SlotPair(directory, lambda index: parts.part_stem(ctx.rank, writer_id, index), BLOCK)
        self.peer: str | None = None
        """The peer node's keeper (None: the job runs on one node)."""
        self.generation = ""
        self._push_paused_until = 0.0
        self._push_warned = False

    def write(self, capture: Capture) -> Written:
        """Phases 1-5 of the module docstring. An error leaves the optimizer step released."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        step, deferred, made = capture.step, capture.deferred, self.slots.created
        if self._ctx.device.type == "cuda":
            torch.cuda.set_device(self._ctx.device)
        try:
            share = capture.build()
            live = {k: v for k, v in share.items() if k not in capture.buffers}
            slot = self.slots.next({k: capture.buffers.get(k, v) for k, v in share.items()})
            self._fault(BEGUN, step)
            deferred.run_pairs(lambda: [(sharded.local_part(live[k]), slot.views[k]) for k in live])
        finally:
            deferred.release()  # on an error too: the optimizer step never waits for a copy that will not come
        for key in share.keys() - live.keys():
            slot.views[key].copy_(sharded.local_part(capture.buffers[key]))
        self._fault(COPIED, step)
        checksums, pool_cpu = pieces_checksums(slot.pieces, BLOCK)
        self._fault(CHECKSUMMED, step)
        blob, blob_crc = parts.encode_trainer(capture.trainer)
        header = PartHeader(
            run_id=self._ctx.run_id, step=step, rank=self._ctx.rank, world_size=self._ctx.world_size,
            writer=self._writer_id, slot=slot.index, data_bytes=slot.layout.size, chunks=[], tensors={},
            trainer=blob, trainer_crc32c=blob_crc, ckpt_dir=self._ckpt_dir, keep=self._keep, created=time.time(),
            extra={"generation": self.generation},
        )
        head = header.to_json({"chunks": slot.render_chunks(checksums), "tensors": slot.tensors_json})
        parts.write_header_bytes(self._directory, header.stem, head)
        committed, cpu = time.perf_counter(), time.thread_time() - cpu_started + pool_cpu
        self._fault(COMMITTED, step)
        replica_cpu = 0.0
        if self.peer is not None and time.monotonic() >= self._push_paused_until:
            replica_started = time.thread_time()
            self._push(header.stem, head, slot.bytes)
            replica_cpu = time.thread_time() - replica_started
        return Written(step, cpu, replica_cpu, committed - capture.began, time.perf_counter() - started,
                       self.slots.created > made)

    def _push(self, stem: str, head: bytes, data: memoryview) -> None:
        """Send the part to the peer's keeper; a failure is one warning (the local copy stands)."""
        assert self.peer is not None
        try:
            push_part(self.peer, self._key, stem, head, data, PUSH_TIMEOUT)
        except (OSError, http.client.HTTPException) as exc:
            # A peer that does not answer must not hold every step: no copies for a while.
            self._push_paused_until = time.monotonic() + PUSH_PAUSE
            if not self._push_warned:
                self._push_warned = True
                logger.warning("cannot copy the snapshot to the peer node's keeper at %s (%s); "
                               "a loss of this node would restore from disk", self.peer, exc)
            return
        self._push_warned = False
