"""The state manager: what the front door calls to save and restore a run's whole training state.

    ckpt = CheckpointManager(ctx, config, model=model, optimizer=optimizer, sampler=sampler, events=events)
    step = ckpt.restore()           # 0 on a fresh start
    while step < max_steps:
        ...train one step...
        step += 1
        ckpt.maybe_save(step)       # a checkpoint every config.ckpt_every steps, a snapshot every snapshot_every
    ckpt.save(step, reason="final"); ckpt.flush()
    ckpt.close()

How it is built, one concern a module:

- restore: planner.py picks the newest step every rank can restore from the
  sources (sources.py: memory_source.py, then disk_source.py), fit.py checks
  it fits this run, loader.py reads it and, all of it verified, applies it;
- save: saver.py copies the state off the loop (snapshot.py), writes every
  rank's part (storage/sharded.py) and commits on rank 0 (storage/commit.py);
  policy.py says what a failed save means; directory_claim.py holds the directory;
- in-memory snapshots: memory.py (into node memory, and to a peer node),
  part_files.py (reading them back from this node or another);
- the state itself: training_state.py (the objects, trainer.pt), state.py
  (model and optimizer tensors by stable key).

Invariants:
- Every method but `snapshot` is called by every rank at the same step (they
  are collectives); ranks agree through elastic._worker.control.agreement only.
- The loop blocks only to copy the state; at most one save and one snapshot
  are in flight, and the optimizer step waits for their copies (a pre-hook).
- Committed checkpoints are never touched by a failure; see saver.py and
  policy.py for what a failed save means, planner.py for the restore.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic._shared.common.errors import CheckpointError, CheckpointStorageError
from elastic._shared.protocol import fault_hook
from elastic._shared.storage.directory import CheckpointStore
from elastic._shared.storage.stores import open_store
from elastic._shared.storage.keeper_address import KeeperAddress
from elastic._shared.storage.peer_auth import SECRET_FILE_ENV, PeerKey, SecretError
from elastic._worker.checkpoint import keeper_client, live_source
from elastic._worker.checkpoint.directory_claim import DirectoryClaim
from elastic._worker.checkpoint.loader import Loader
from elastic._worker.checkpoint.memory import MemorySnapshots
from elastic._worker.checkpoint.planner import Restored, RestorePlanner
from elastic._worker.checkpoint.policy import FailurePolicy
from elastic._worker.checkpoint.saver import Saver
from elastic._worker.checkpoint.snapshot_interval import SnapshotInterval
from elastic._worker.checkpoint.sources import DISK
from elastic._worker.checkpoint.training_state import Stateful, TrainingState
from elastic._worker.config import RunConfig
from elastic._worker.control import agreement
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.observe.events import EventLog
from elastic._worker.runtime.context import WorkerContext, barrier

logger = logging.getLogger(__name__)

NO_CHECKPOINTS = ("no --ckpt-dir: this job keeps no checkpoints and no in-memory snapshots, so a failure restarts "
                  "training from step 0; give --ckpt-dir DIR (or s3://BUCKET/PREFIX) to resume where it stopped")
_SOURCE_WORDS = {"disk": "", "memory": " in memory", "peer": " in a peer node's memory"}


class CheckpointManager:
    """One worker's checkpoints and snapshots (see the module docstring)."""

    def __init__(
        self,
        ctx: WorkerContext,
        config: RunConfig,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: ElasticSampler,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        scaler: torch.amp.GradScaler | None = None,
        extra: Mapping[str, Stateful] | None = None,
        events: EventLog | None = None,
        faults: fault_hook.FaultHook | None = None,
    ) -> None:
        self._ctx = ctx
        self.config = config
        self.enabled = config.ckpt_dir is not None
        # A directory or a bucket (storage/stores.py): a bucket that cannot be used is one line, exit 2, here.
        self.store = open_store(config.ckpt_dir, keep=config.ckpt_keep) if self.enabled else CheckpointStore(
            ".", keep=config.ckpt_keep)
        self.state = TrainingState(
            model=model, optimizer=optimizer, sampler=sampler, scheduler=scheduler, scaler=scaler, extra=extra,
            seed=config.seed,
        )
        self._events = events or EventLog(None, restart=ctx.restart_count)
        self.faults = faults if faults is not None else fault_hook.for_worker(ctx.rank, ctx.restart_count,
                                                                                       ctx.env.variables)
        save_group = restore_group = None
        if self.enabled and ctx.distributed:
            # Saves run their collectives on the writer threads: a group of their own, never the loop's.
            save_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=config.ckpt_timeout + 60))
            # A restore's collectives wait no longer than its deadline for a rank stuck reading.
            restore_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=config.ckpt_restore_timeout))
        copy_stream = torch.cuda.Stream(ctx.device) if ctx.device.type == "cuda" else None
        # Without --ckpt-dir nothing is claimed (the store on "." only serves the code paths; nothing is written).
        self.claim = DirectoryClaim(self.store, ctx.run_id) if ctx.is_main and self.enabled else None
        self.policy = FailurePolicy(ctx, self.store, self._events, max_failures=config.ckpt_max_failures)
        self.saver = Saver(
            ctx, self.state, self.store, self._events, self.policy, self.claim, group=save_group,
            timeout=config.ckpt_timeout, wait_slice=config.ckpt_wait_slice, fault=self._fault, copy_stream=copy_stream,
        )
        self.loader = Loader(
            ctx, self.state, self.store, group=restore_group, restore_timeout=config.ckpt_restore_timeout,
            fault=self._fault,
        )
        self.snapshot_interval = SnapshotInterval(
            config.snapshot_every, world_size=ctx.world_size, mtbf_hours=config.mtbf_hours,
            ckpt_every=config.ckpt_every_steps, announce=ctx.is_main,
        )
        self.memory = self._memory_tier(copy_stream) if self.enabled and config.snapshot_every != 0 else None
        self.hook_seconds = 0.0
        """Seconds the optimizer steps waited in this manager's pre-hook (saves' and snapshots' copies)."""
        self.restored_bytes = 0
        """Bytes of tensor data this rank read on restore (each chunk it needed, once)."""
        self.fetched_bytes = 0
        """Of those, bytes this rank fetched from other nodes' snapshot keepers (with the blocks around them)."""
        self._hook = None
        if self.enabled:
            # Parameters and optimizer state change only in optimizer.step(): the copies may run
            # until then, and this hook holds the step until they have.
            self._hook = optimizer.register_step_pre_hook(lambda *_: self._before_optimizer_step())

    def _fault(self, point: str, step: int) -> None:
        self.faults.at(point, step)

    def _memory_tier(self, copy_stream: torch.cuda.Stream | None) -> MemorySnapshots | None:
        keeper = KeeperAddress.from_env(self._ctx.env.variables)
        keeper_client.use_tls_of(self._ctx.env.variables)  # how keepers' certificates are checked
        if keeper is None:
            if self._ctx.is_main:
                logger.info(
                    "in-memory snapshots are off: no snapshot keeper runs on this node (start the job with "
                    "torchrevive-run for them); a failure resumes from the last checkpoint on disk"
                )
            return None
        try:
            key = PeerKey.from_env(self._ctx.env.variables)
        except SecretError as exc:
            key, why = None, str(exc)
        else:
            why = f"no snapshot secret ({SECRET_FILE_ENV} is not set)"
        if key is None:
            if self._ctx.is_main:
                logger.warning("in-memory snapshots are off: %s; a failure resumes from the last checkpoint on disk", why)
            return None
        return MemorySnapshots(
            self._ctx, keeper, self.state, key=key, every=self.snapshot_interval.every, ckpt_dir=str(self.store.root.resolve()),
            keep=self.config.ckpt_keep, fault=self._fault, copy_stream=copy_stream,
        )

    # -- what the loop sees ------------------------------------------------------------

    @property
    def every(self) -> int:
        return self.config.ckpt_every_steps

    @property
    def history(self) -> list[dict[str, float]]:
        """Per committed save: step, seconds (start to commit), blocking_seconds (rank 0)."""
        return self.policy.history

    @property
    def last_step(self) -> int | None:
        """The newest step saved or restored from disk: a save at this step again is skipped."""
        return self.saver.last_step

    @property
    def must_stop(self) -> bool:
        """Rank 0: `ckpt_max_failures` periodic saves failed in a row (`stop_reason` says why)."""
        return self.policy.stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        return self.policy.stop_reason

    def share_stop_reason(self) -> str:
        """Rank 0's `stop_reason` on every rank (a collective, after a vote said to stop)."""
        return agreement.main_text(self._ctx, self.policy.stop_reason) or "checkpoint saves keep failing"

    def due(self, step: int) -> bool:
        """A checkpoint is due at the end of `step`: every `--ckpt-every` steps, or in epochs (2e) when the step
        completed an epoch that is a multiple (its global batch reached into the next epoch's first samples)."""
        epochs, sampler = self.config.ckpt_every_epochs, self.state.sampler
        if epochs:
            crossed = sampler.state.consumed < sampler.batch_size * self._ctx.world_size
            return self.enabled and crossed and sampler.epoch % epochs == 0
        return self.enabled and self.every > 0 and step % self.every == 0

    # -- restore -------------------------------------------------------------------------

    def restore(self) -> int:
        """Load the newest good state on every rank; the step to continue from (0: none)."""
        if not self.enabled:
            if self._ctx.is_main and self._ctx.distributed:  # a restart would begin again: say it once, at start
                logger.warning(NO_CHECKPOINTS)
            return 0
        planner = RestorePlanner(
            self._ctx, self.state, self.store, self.loader, self.memory,
            restore_timeout=self.config.ckpt_restore_timeout,
        )
        restored = planner.restore(self.claim)
        self.memory = planner.memory  # off everywhere when a node has no keeper
        self.saver.tag = planner.tag
        return self._report(restored) if restored is not None else 0

    def _report(self, restored: Restored) -> int:
        """Every rank: the `restore` event and line, once every rank has loaded."""
        ctx, offer = self._ctx, restored.offer
        barrier(ctx)
        seconds = time.perf_counter() - restored.started
        manifest = offer.parsed_manifest
        disk = offer.source == DISK
        # A snapshot's step is not on disk yet (the keeper may still be writing it): a final
        # save at this very step must not be skipped as already saved.
        self.saver.last_step = manifest.step if disk else None
        self.restored_bytes = restored.bytes_read
        self.fetched_bytes = 0 if disk else restored.bytes_fetched
        read, fetched = agreement.sum_ints(ctx, [self.restored_bytes, self.fetched_bytes])
        redone = self._steps_redone(manifest.step)
        self._events.emit(
            "restore", step=manifest.step, world_size=ctx.world_size, seconds=seconds, checkpoint=offer.checkpoint,
            saved_world_size=manifest.world_size, bytes_read=read, source=offer.source,
            **({"bytes_fetched": fetched} if not disk else {}),
            **({"redone": redone} if redone is not None else {}),
        )
        if ctx.is_main:
            logger.info(
                "resumed from %s%s (step %d, saved at world size %d) in %.2f s%s",
                offer.checkpoint, _SOURCE_WORDS[offer.source], manifest.step, manifest.world_size, seconds,
                f"; {redone} step(s) to redo" if redone is not None else "",
            )
        return manifest.step

    def take_over(self, earlier: CheckpointManager) -> None:
        """Carry on from `earlier`, closed by a heal: its save tag and newest step on disk."""
        self.saver.tag, self.saver.last_step = earlier.saver.tag, earlier.saver.last_step

    def restore_live(self, *, source: int, step: int, take: bool, replacement: bool, new_tag: bool = False) -> int:
        """A heal in place: every member of the new group takes rank `source`'s state of step
        `step` from its memory (`live_source.share`; `take=False` where it holds it already), and
        this fresh manager takes over from the one the heal dropped: the directory claim, the save
        tag and the newest step on disk. Every rank: the `restore` event ("source": "live").
        A collective of every member, in the place a restart's `restore` would be. `new_tag`: the
        group is not the last one (another world size, other members): the source draws a new save
        tag, so the snapshots of this group are never taken for parts of the last one's."""
        ctx, started = self._ctx, time.perf_counter()
        claimed: CheckpointError | None = None
        if self.claim is not None:
            try:
                self.claim.prepare()
            except CheckpointError as exc:
                claimed = exc
        if not agreement.all_ok(ctx, claimed is None):
            raise claimed or CheckpointStorageError(f"rank 0 cannot claim checkpoint directory {self.store.root}")
        if not agreement.all_ok(ctx, self.memory is not None) and self.memory is not None:
            self.memory.close(timeout=0)  # a node without a keeper: off everywhere, as at a restore
            self.memory = None
        if self.memory is not None:
            self.memory.connect()  # this node's peer for snapshot copies (a collective)
        tag = uuid.uuid4().hex[:8] if new_tag else self.saver.tag  # only the source's travels
        mine = {"tag": tag, "last_step": -1 if self.saver.last_step is None else self.saver.last_step}
        received = live_source.share(ctx, self.state, source=source, step=step, take=take, extras=mine,
                                     replacement=replacement, fault=self._fault)
        tag, last_step = received.extras.get("tag"), received.extras.get("last_step")
        if not (isinstance(tag, str) and len(tag) <= 64 and (tag == "" or tag.isalnum()) and isinstance(last_step, int)):
            raise live_source.LivePeerError(f"rank {source} sent a malformed save tag {tag!r} or step {last_step!r}")
        self.saver.tag, self.saver.last_step = tag, (last_step if last_step >= 0 else None)
        if self.memory is not None:
            self.memory.generation = tag
            self.memory.reset_progress(step)
        (received_bytes,) = agreement.sum_ints(ctx, [received.bytes_received])
        seconds = time.perf_counter() - started
        self._events.emit(
            "restore", step=step, world_size=ctx.world_size, seconds=seconds, checkpoint=None, saved_world_size=ctx.world_size,
            bytes_read=0, bytes_received=received_bytes, source="live", source_rank=source, redone=0,
        )
        if ctx.is_main:
            logger.info("took the state of step %d from rank %d's memory (live) in %.2f s: %d bytes received",
                        step, source, seconds, received_bytes)
        return step

    def _steps_redone(self, step: int) -> int | None:
        """Steps finished before the failure that the job trains again (the newest step any
        node's workers noted, less the restored one); None when no node noted any (a first start,
        or no keeper). A collective."""
        progress = self.memory.last_progress() if self.memory is not None else None
        newest = agreement.max_int(self._ctx, -1 if progress is None else progress)
        if self.memory is not None:
            self.memory.reset_progress(step)  # every node has read its notes
        return max(0, newest - step) if newest >= 0 else None

    # -- save ------------------------------------------------------------------------------

    def snapshot_proposal(self) -> int:
        """This rank's ballot for the snapshot interval (the step vote carries it); 0: no snapshots here."""
        return self.snapshot_interval.proposal() if self.memory is not None else 0

    def agree_snapshot_interval(self, every: int, step: int) -> None:
        """The interval every rank agreed on (the step vote's verdict), from this step on."""
        if self.memory is not None:
            self.snapshot_interval.agree(every, step)
            self.memory.every = self.snapshot_interval.every

    def maybe_save(self, step: int) -> None:
        """Save when `step` is a multiple of `every`; report saves that finished meanwhile; take
        the in-memory snapshot when one is due."""
        if self.memory is not None:
            self.memory.note_step(step)
            self.snapshot_interval.note_step_end()
            for cost, replica in self.memory.costs.drain():
                self.snapshot_interval.note_cost(cost, replica)
        if self.due(step):
            self.save(step)
        elif self.enabled:
            self.saver.collect(block=False)
        if self.memory is not None and self.memory.due(step):
            self.snapshot(step)

    def save(self, step: int, reason: str = "periodic") -> None:
        """Start saving the state as of now (a collective); see saver.py."""
        if self.enabled:
            self.saver.save(step, reason)

    def snapshot(self, step: int) -> None:
        """Copy the state of `step` into this node's shared memory (not a collective; see memory.py)."""
        if self.memory is not None:
            self.memory.take(step)

    def flush(self) -> None:
        """Wait until every save is committed or failed, on every rank (a collective); raises
        `CheckpointStorageError` on every rank when a final or preemption save did not commit."""
        if self.enabled:
            self.saver.flush()

    def loop_seconds(self) -> dict[str, float]:
        """Seconds the loop spent in snapshots, and in this manager's optimizer pre-hook otherwise, for
        the step costs: what to add to each phase when `maybe_save` was charged to "checkpoint"."""
        costs = self.memory.costs if self.memory is not None else None
        taken = costs.blocked_seconds if costs is not None else 0.0
        copied = costs.capture_seconds if costs is not None else 0.0
        step_waits = costs.step_wait_seconds if costs is not None else 0.0
        return {"snapshot_copy": copied, "snapshot_wait": taken - copied + step_waits,
                "checkpoint": self.hook_seconds - step_waits - taken}

    def _before_optimizer_step(self) -> None:
        started = time.perf_counter()
        if self.memory is not None:
            self.memory.before_optimizer_step()
        self.saver.before_optimizer_step()
        self.hook_seconds += time.perf_counter() - started

    def close(self, wait: float | None = None, *, ended: bool = False) -> None:
        """Commit what is in flight (waiting at most `wait`, default `ckpt_timeout`) and detach from
        the optimizer; safe on error paths, where a failed save is only reported. `ended`: the job
        ended cleanly (finished, preempted, stopped for its storage), so rank 0 marks its claim on the
        directory as ended and another job may take it at once (storage.claim.release)."""
        wait = self.config.ckpt_timeout if wait is None else wait
        if self.policy.fatal is not None:
            wait = 0.0  # flush already waited --ckpt-timeout for it
        try:
            self.saver.close(wait)
        finally:
            if self.claim is not None:
                self.claim.stop()
                if ended:
                    self.claim.release()
            if self.memory is not None:
                self.memory.close(timeout=wait)
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
