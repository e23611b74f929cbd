"""Saving: copy the state off the loop, write every rank's part in parallel, commit on rank 0.

Invariants:
- Every rank writes its part, in parallel, on its own writer thread, through
  torch.distributed.checkpoint on a gloo group of its own (storage/sharded.py):
  its shards of sharded (FSDP2) tensors and the replicated tensors `owners`
  gives it, so each byte is written once. Rank 0 then commits through
  `storage.commit.commit_checkpoint`, the one commit every writer uses
  (trainer.pt with every rank's RNG states, tensors.json, the manifest, the
  claim, the atomic rename).
- The loop blocks only to copy the state (snapshot.py): buffers and the trainer
  state at once, parameters and optimizer state on the writer thread before
  the next optimizer step (`before_optimizer_step` waits for that copy).
- At most one save is in flight. A periodic save due while the previous one is
  still being written waits one short slice at most, then is skipped (event
  `checkpoint_skipped`); after one skip, later ones skip at once until a save
  keeps up again, so slow storage costs skipped saves, never steps, and never
  nears the watchdog or collective timeouts.
- A failed save is an outcome judged by the policy (policy.py), never an
  exception on the writer thread; its temporary directory is removed.
- `flush` waits in slices with a short collective after each, so slow storage
  never trips the collective timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.utils import CheckpointException

from elastic._shared.common.errors import CheckpointStorageError, first_line
from elastic._shared.storage import sharded
from elastic._shared.storage.checkpoint_storage import CheckpointStorage
from elastic._shared.storage.commit import commit_checkpoint
from elastic._shared.storage.durable import SaveFailed, describe_failure
from elastic._shared.storage.manifest import checkpoint_name
from elastic._worker.checkpoint import state as live_state
from elastic._worker.checkpoint.directory_claim import DirectoryClaim
from elastic._worker.checkpoint.policy import FailurePolicy
from elastic._worker.checkpoint.snapshot import BufferPool, DeferredCopy, copy_now
from elastic._worker.checkpoint.training_state import TrainingState
from elastic._worker.checkpoint.writer import BackgroundWriter
from elastic._worker.control import agreement
from elastic._worker.observe.events import EventLog
from elastic._worker.runtime.context import WorkerContext

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Outcome:
    """What the writer thread reports for one save."""

    finished: float
    """Unix time the save committed or failed."""
    error: str | None
    """One line naming why it failed; None when it committed."""


@dataclass
class _SaveRecord:
    """One save, from the loop's call to the writer's commit."""

    step: int
    reason: str
    started: float
    blocking_seconds: float
    trainer: dict[str, Any] | None
    """Rank 0: sampler, scheduler, scaler, extra, optimizer settings, RNG, step, copied at the save."""
    buffers: dict[str, torch.Tensor]
    """Copies of this rank's share of the model's buffers (a forward pass changes them), by key."""
    sources: dict[str, torch.Tensor] | None
    """This rank's share of parameters and optimizer state: live tensors, copied on the writer
    thread (None: which ones is settled there too)."""
    deferred: DeferredCopy
    """The copy of `sources`, which the optimizer step waits for."""
    sources_released: bool = False


class Saver:
    """One rank's saves (see the module docstring). Every method is called by every rank at the same step."""

    def __init__(
        self, ctx: WorkerContext, state: TrainingState, store: CheckpointStorage[Any], events: EventLog,
        policy: FailurePolicy, claim: DirectoryClaim | None, *, group: dist.ProcessGroup | None, timeout: float,
        wait_slice: float, fault: Callable[[str, int], None], copy_stream: torch.cuda.Stream | None,
    ) -> None:
        self._ctx = ctx
        self.state = state
        self.store = store
        self._events = events
        self.policy = policy
        self._claim = claim
        self._group = group
        self.timeout = timeout
        """Seconds a final or preemption save may take to commit, waiting for one in flight included."""
        self._wait_slice = wait_slice
        self._fault = fault
        self._copy_stream = copy_stream
        self._writer = BackgroundWriter(drain_timeout=timeout)
        self._pool = BufferPool(pin_memory=ctx.device.type == "cuda")
        self._mine_keys: frozenset[str] = frozenset()  # writer thread: the keys of this rank's share
        self._in_flight: _SaveRecord | None = None
        self._storage_behind = False  # rank 0: a periodic save was skipped and none kept up since
        self.tag = ""
        """Shared by every rank (set at restore): names the temporary directory of each save."""
        self.last_step: int | None = None
        """The newest step saved or restored from disk: a save at this step again is skipped."""

    # -- the loop's side -------------------------------------------------------------

    def save(self, step: int, reason: str = "periodic") -> None:
        """Start saving the state as of now (a collective); returns once the state is copied.
        A final or preemption save first waits, within `timeout`, for the one in flight."""
        if reason == "periodic":
            if step == self.last_step or self._still_writing(step):
                return
        else:
            self.flush()  # the one in flight first: at most one save at a time
            # A step already saved is not saved again, unless that save failed.
            if step == self.last_step and not agreement.main_flag(self._ctx, self.policy.last_save_failed):
                return
        ctx, state = self._ctx, self.state
        started, wall_started = time.perf_counter(), time.time()
        # Every rank checks the extra state, so a bad one fails everywhere at this step, not on rank 0 alone.
        extra = state.extra_state()
        settings = state.optimizer_settings()
        rng_states = state.gather_rng(ctx)
        self.last_step = step
        if self._claim is not None:
            self._claim.prepare()
        layout = state.layout
        if layout.sharded:
            # FSDP2 swaps the registered parameters in every forward: which tensors to save is
            # settled here, on the loop's thread, between steps.
            mine: dict[str, torch.Tensor] | None = layout.share(layout.tensors(), ctx.rank, ctx.world_size)
            buffers = {k: v for k, v in mine.items() if k in layout.buffer_keys}
        else:
            # Parameters and optimizer state are the same tensors from step to step: which of them
            # this rank saves is settled on the writer thread, off the loop (see snapshot.py).
            mine = None
            buffers = {live_state.MODEL_PREFIX + name: b for name, b in state.model.named_buffers()}
        trainer = state.trainer_state(step, ctx.world_size, rng_states, extra, settings) if ctx.is_main else None
        now = copy_now({"trainer": trainer, "buffers": buffers}, self._pool, ctx.device, self._copy_stream)
        record = _SaveRecord(
            step, reason, wall_started, 0.0, now["trainer"], now["buffers"],
            {k: v for k, v in mine.items() if k not in layout.buffer_keys} if mine is not None else None,
            DeferredCopy(ctx.device, self._copy_stream),
        )
        self._in_flight = record
        self._writer.submit(lambda: self._write(record))
        record.blocking_seconds += time.perf_counter() - started

    def before_optimizer_step(self) -> None:
        """Optimizer step pre-hook: the step may change parameters once the save has read them."""
        record = self._in_flight
        if record is None or record.sources_released:
            return
        started = time.perf_counter()
        record.deferred.wait_sources_free()
        record.sources_released = True
        record.blocking_seconds += time.perf_counter() - started

    def _still_writing(self, step: int) -> bool:
        """Whether rank 0 is still writing the previous save (a collective: every rank skips alike)."""
        busy = False
        if self._ctx.is_main:
            self.collect(block=False)
            if self._in_flight is None:
                self._storage_behind = False  # the last save kept up with the interval
            elif not self._storage_behind:
                # Nearly done is worth a short wait (one slice); after one that was not,
                # skip at once until a save keeps up again, so slow storage costs no steps.
                try:
                    self.collect(block=True, timeout=self._wait_slice)
                except TimeoutError:
                    self._storage_behind = True
            busy = self._in_flight is not None
        busy = agreement.main_flag(self._ctx, busy)
        if busy and self._ctx.is_main:
            writing = self._in_flight.step if self._in_flight is not None else None
            logger.warning(
                "skipping the checkpoint of step %d: the one of step %s is still being written (slow storage?)",
                step, writing,
            )
            self._events.emit("checkpoint_skipped", step=step, world_size=self._ctx.world_size, writing=writing)
        elif not busy and not self._ctx.is_main:
            self.collect(block=True)  # rank 0 is done, so this rank's part has left every collective
        return busy

    def flush(self) -> None:
        """Wait until every save is committed or failed, on every rank (a collective).

        Rank 0 waits in slices of `wait_slice` seconds with a short collective
        after each; after `timeout` seconds it gives up. Raises
        `CheckpointStorageError` on every rank when a final or preemption save
        failed or did not commit in time.
        """
        deadline = time.monotonic() + self.timeout
        while True:
            writing = False
            if self._ctx.is_main:
                remaining = deadline - time.monotonic()
                try:
                    self.collect(block=True, timeout=max(0.0, min(self._wait_slice, remaining)))
                except TimeoutError:
                    if remaining > self._wait_slice:
                        writing = True
                    else:
                        self.policy.fatal = self.policy.fatal or self.timed_out()
            if not agreement.main_flag(self._ctx, writing):
                break
        fatal = agreement.main_text(self._ctx, self.policy.fatal)
        if fatal is not None:
            raise CheckpointStorageError(fatal)
        if not self._ctx.is_main:
            # Rank 0's save is over, so this rank's part has left every collective of it.
            try:
                self.collect(block=True, timeout=self._wait_slice)
            except TimeoutError:
                logger.warning("this rank's part of the checkpoint is still finishing after rank 0 committed it")

    def timed_out(self, waited: float | None = None) -> str:
        record = self._in_flight
        what = f"the {record.reason} checkpoint of step {record.step}" if record else "a checkpoint"
        return self.policy.timed_out(what, self.timeout if waited is None else waited)

    def collect(self, *, block: bool, timeout: float | None = None) -> None:
        """Report the save in flight if it has finished (waiting for it if `block`, at most
        `timeout` seconds: `TimeoutError` then, and it stays in flight). Only rank 0 reports."""
        record = self._in_flight
        if record is None or (not block and self._writer.busy):
            return
        outcome: _Outcome | None = self._writer.wait(timeout)
        self._in_flight = None
        if outcome is None:  # an earlier `close` stopped the writer after the save ended: nothing to report
            return
        if not self._ctx.is_main:
            return
        if outcome.error is not None:
            self.policy.failed(record.step, record.reason, outcome.error)
        else:
            self.policy.committed(record.step, record.reason, record.started, record.blocking_seconds, outcome.finished)

    def close(self, wait: float) -> None:
        """Commit what is in flight (waiting at most `wait`); past it the save is abandoned to its
        daemon thread and the exit does not wait for it. Safe on error paths."""
        try:
            if self._in_flight is not None:
                record = self._in_flight
                try:
                    self.collect(block=True, timeout=wait)
                except TimeoutError:
                    self._writer.drain_timeout = 0  # nor at interpreter exit
                    if self._ctx.is_main:
                        logger.warning("%s", self.timed_out(wait))
                except Exception as exc:  # noqa: BLE001 - its collectives met a dead peer: a group left after a failure
                    self._in_flight = None
                    logger.warning("rank %d: the %s checkpoint of step %d did not commit: %s", self._ctx.rank,
                                   record.reason, record.step, first_line(exc))
        finally:
            try:
                self._writer.close(timeout=0 if self._writer.busy else None)
            except TimeoutError:
                pass  # reported above; the daemon thread finishes or dies with the process
            except Exception as exc:  # noqa: BLE001 - a non-main rank's part of a failed save: rank 0 reported it
                logger.debug("checkpoint writer: %s", exc)

    # -- the writer thread -----------------------------------------------------------

    def _write(self, record: _SaveRecord) -> _Outcome:
        """Every rank: copy this rank's share, write it (a collective over the checkpoint group);
        rank 0 then commits. A storage failure is an outcome (the loop goes on), not an
        exception; anything else is a bug and raises."""
        ctx = self._ctx
        if ctx.device.type == "cuda":
            torch.cuda.set_device(ctx.device)  # this thread's allocations and copies belong to this rank's GPU
        name = checkpoint_name(record.step)
        tmp = self.store.begin(record.step, self.tag)
        copy_error: str | None = None
        try:
            tensors = record.deferred.run(lambda: self._sources(record), self._pool)
            tensors.update((k, v) for k, v in record.buffers.items() if k in self._mine_keys)
        except Exception as exc:  # noqa: BLE001 - out of (pinned) memory: a failed save, on every rank alike
            copy_error = f"rank {ctx.rank} could not copy its state: {describe_failure(exc)}"
        # Every rank says whether it has its part before any joins DCP: one that has not must not
        # leave the others waiting in DCP's collectives.
        if not agreement.all_ok(ctx, copy_error is None, self._group):
            if ctx.is_main:
                self.store.abort(tmp)
            what = copy_error or "another rank could not copy its state (its log says why)"
            return _Outcome(time.time(), f"cannot write {name} to {self.store.root}: {what}")
        try:
            writer = sharded.save_tensors(
                tensors, tmp, group=self._group, after_first_item=lambda: self._fault("during_write", record.step),
                sink=self.store.part_sink(tmp),
            )
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's CheckpointException (a BaseException), on every rank
            if ctx.is_main:
                self.store.abort(tmp)
            return _Outcome(time.time(), f"cannot write {name} to {self.store.root}: {describe_failure(sharded.first_error(exc))}")
        if not ctx.is_main:
            return _Outcome(time.time(), None)
        assert record.trainer is not None and self._claim is not None
        try:
            # The shard files from what every rank reported writing, not a directory listing
            # (another host's files can be missing from this host's cached view of the directory).
            commit_checkpoint(
                self.store, tmp, step=record.step, world_size=ctx.world_size, shard_sizes=writer.file_sizes,
                tensors_json=writer.tensors_json.encode("utf-8"), trainer=record.trainer, reason=record.reason,
                run_id=ctx.run_id, owner=self._claim.identity,
                before_commit=lambda: self._fault("before_commit", record.step),
            )
        except SaveFailed as exc:
            return _Outcome(time.time(), str(exc))
        return _Outcome(time.time(), None)

    def _sources(self, record: _SaveRecord) -> dict[str, torch.Tensor]:
        """Writer thread: this rank's share of the live tensors, buffers left out (copied already);
        `_mine_keys` says which of the buffer copies are this rank's to write."""
        if record.sources is not None:
            self._mine_keys = frozenset(record.sources) | frozenset(record.buffers)
            return record.sources
        layout = self.state.layout
        mine = layout.share(layout.tensors(), self._ctx.rank, self._ctx.world_size)
        self._mine_keys = frozenset(mine)
        return {k: v for k, v in mine.items() if k not in layout.buffer_keys}
