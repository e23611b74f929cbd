"""The state manager: what a recipe calls to save and restore its whole training state.

    ckpt = CheckpointManager(ctx, args.ckpt_dir, every=args.ckpt_every, model=model,
                             optimizer=optimizer, scheduler=scheduler, sampler=sampler,
                             events=events, seed=args.seed)
    step = ckpt.restore()           # 0 on a fresh start
    while step < max_steps:
        ...train one step...
        step += 1
        ckpt.maybe_save(step)
    ckpt.save(step, reason="final")
    ckpt.close()

Invariants:
- Every method is called by every rank at the same step (they are collectives).
- Rank 0 writes: under DDP the model and optimizer are replicated, so its copy
  is everyone's. Only the RNG states differ per rank; they are gathered to
  rank 0 and stored per rank.
- `extra` objects (anything with `state_dict`/`load_state_dict`: an EMA, a
  data pipeline, counters) are saved by name beside the sampler, from rank 0,
  copied when the save is asked for; like the model they must hold the same
  state on every rank. Their state dicts must be tensors and plain values
  (checkpoints load with `weights_only=True`).
- `restore` loads the newest checkpoint that verifies, on every rank, onto the
  rank's own device, between barriers, before the first step. A corrupt one
  is moved aside with a warning naming it; a checkpoint of another model or
  data set raises `CheckpointMismatchError` before anything is changed.
- The loop blocks only to copy the state (see snapshot.py); at most one save
  is in flight, and a periodic save due while the previous one is still being
  written waits one short slice at most, then is skipped (event
  `checkpoint_skipped`); see `save`.
- A save that fails (full disk, quota, I/O error) is a warning and a
  `checkpoint_failed` event; its temporary directory is removed and training
  goes on. `max_failures` periodic failures in a row set `must_stop` (rank 0;
  `elastic.Run` turns it into `CheckpointStorageError` on every rank at the
  next step); a final or preemption save that fails or does not commit within
  `timeout` raises it from `flush` on every rank. Committed checkpoints are
  never touched by a failure.
- `flush` waits in slices with a short collective after each, so slow storage
  never trips the collective timeout. `restore` checks the storage takes a
  write and has room for one more checkpoint: a restart on broken storage
  stops at once instead of training into the same failure.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from elastic.chaos import FaultInjector
from elastic.checkpoint import compat
from elastic.checkpoint.snapshot import BufferPool, DeferredCopy, copy_now
from elastic.checkpoint.store import (
    Candidate,
    CheckpointStore,
    CorruptCheckpoint,
    Manifest,
    SaveFailed,
    checkpoint_name,
    describe_failure,
    versions,
)
from elastic.checkpoint.writer import BackgroundWriter
from elastic.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointStorageError,
    UsageError,
)
from elastic.events import EventLog
from elastic.rng import get_rng_state, seed_all, set_rng_state
from elastic.runtime import WorkerContext, barrier, control_group
from elastic.sampler import ElasticSampler

logger = logging.getLogger(__name__)

MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
TRAINER_FILE = "trainer.pt"

# Ranks a grown job has no saved RNG state for are seeded from (seed, step, rank).
_RESEED_STRIDE = 1_000_003


_PLAIN_LEAVES = (torch.Tensor, int, float, bool, str, bytes, type(None))


def plain_state(name: str, tree: Any, path: str = "") -> Any:
    """`tree` if a `weights_only` load can read it back (tensors and plain values in dicts,
    lists and tuples); else a `UsageError` at save time, not a failed restore later."""
    if isinstance(tree, _PLAIN_LEAVES) and (isinstance(tree, torch.Tensor) or type(tree) in _PLAIN_LEAVES):
        return tree
    if type(tree) is dict:
        for key, value in tree.items():
            plain_state(name, value, f"{path}[{key!r}]")
        return tree
    if type(tree) in (list, tuple):
        for i, value in enumerate(tree):
            plain_state(name, value, f"{path}[{i}]")
        return tree
    raise UsageError(
        f"extra state {name!r}: state_dict(){path} is a {type(tree).__module__}.{type(tree).__qualname__}; "
        "checkpoints hold tensors and plain values only (int, float, str, lists, dicts: convert it)"
    )


class Stateful(Protocol):
    """What an extra object needs to be checkpointed (torch.distributed.checkpoint's protocol)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


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
    trainer: dict[str, Any]
    """Sampler, scheduler, scaler, RNG, step: copied when the save was asked for."""
    buffers: dict[str, torch.Tensor]
    """Copies of the model's buffers (a forward pass changes them), by state_dict key."""
    deferred: DeferredCopy
    """Parameters and optimizer state, built and copied on the writer thread."""
    sources_released: bool = False


class CheckpointManager:
    def __init__(
        self,
        ctx: WorkerContext,
        directory: str | os.PathLike[str] | None,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: ElasticSampler,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        scaler: torch.amp.GradScaler | None = None,
        every: int = 0,
        keep: int = 3,
        events: EventLog | None = None,
        seed: int = 0,
        extra: Mapping[str, Stateful] | None = None,
        max_failures: int = 3,
        timeout: float = 600.0,
        wait_slice: float = 5.0,
    ) -> None:
        self._ctx = ctx
        self.enabled = directory is not None
        self.store = CheckpointStore(directory if directory is not None else ".", keep=keep)
        self._model = model
        self._optimizer = optimizer
        self._sampler = sampler
        self._scheduler = scheduler
        self._scaler = scaler
        self._extra = dict(extra or {})
        for name, obj in self._extra.items():
            if not callable(getattr(obj, "state_dict", None)) or not callable(getattr(obj, "load_state_dict", None)):
                raise TypeError(f"extra state {name!r} ({type(obj).__name__}) has no state_dict/load_state_dict")
        if max_failures < 1 or timeout <= 0 or wait_slice <= 0:
            raise UsageError(f"max_failures={max_failures} must be 1 or more, timeout={timeout} and wait_slice above 0")
        self.every = every
        self.max_failures = max_failures
        """Periodic saves that may fail in a row before the job stops (`CheckpointStorageError`)."""
        self.timeout = timeout
        """Seconds a final or preemption save may take to commit, waiting for one in flight included."""
        self._wait_slice = wait_slice
        self._events = events or EventLog(None, restart=ctx.restart_count)
        self._seed = seed
        self._writer = BackgroundWriter(drain_timeout=timeout)
        self._faults = FaultInjector(ctx.rank, ctx.restart_count)
        self._pool = BufferPool(pin_memory=ctx.device.type == "cuda")
        self._copy_stream = torch.cuda.Stream(ctx.device) if ctx.device.type == "cuda" else None
        self._in_flight: _SaveRecord | None = None
        self._storage_behind = False  # rank 0: a periodic save was skipped and none kept up since
        self._failures_in_a_row = 0  # rank 0: periodic saves failed since the last commit
        self._last_save_failed = False  # rank 0: the newest save did not commit
        self._stop_reason: str | None = None  # rank 0: why the job must stop (saves keep failing)
        self._fatal: str | None = None  # rank 0: a final or preemption save that did not commit
        self._prepared = False  # directory created and stale temporaries removed (rank 0)
        self.last_step: int | None = None
        """The newest step saved or restored: a save at this step again is skipped."""
        self.history: list[dict[str, float]] = []
        """Per committed save: step, seconds (start to commit), blocking_seconds (rank 0)."""
        self._hook = None
        if self.enabled and ctx.is_main:
            # Parameters and optimizer state change only in optimizer.step(): their copy
            # may run until then, and this hook holds the step until it has.
            self._hook = optimizer.register_step_pre_hook(lambda *_: self._wait_sources_free())

    # -- restore ---------------------------------------------------------------

    def restore(self) -> int:
        """Load the newest good checkpoint on every rank; the step to continue from (0: none)."""
        if not self.enabled:
            return 0
        started = time.perf_counter()
        choice: list[Any] = [None]
        preloaded = None
        if self._ctx.is_main:
            try:
                self._prepare()  # a storage that refuses writes stops a restart here, before any training
                preloaded = self._select()
                if preloaded is not None:
                    self.store.check_room(preloaded[1].total_bytes)  # the next save would not fit
                choice[0] = preloaded[0].name if preloaded else None
            except CheckpointError as exc:
                choice[0] = exc  # every rank raises the same error
        if self._ctx.distributed:
            dist.broadcast_object_list(choice, src=0, group=control_group())
        if isinstance(choice[0], CheckpointError):
            raise choice[0]
        if choice[0] is None:
            barrier(self._ctx)
            logger.info("no checkpoint in %s: starting at step 0", self.store.root)
            return 0

        name = choice[0]
        if preloaded is not None:
            candidate, manifest, state = preloaded
        else:
            candidate = Candidate(name, int(name.split("_")[1]), self.store.root / name)
            if not candidate.path.is_dir():
                raise CheckpointError(
                    f"rank {self._ctx.rank} cannot see {candidate.path}: --ckpt-dir must be storage every node shares"
                )
            try:
                manifest, state = self.store.load(candidate, map_location=self._ctx.device)
            except CorruptCheckpoint as exc:
                raise CheckpointError(f"rank {self._ctx.rank} read a different {name} than rank 0: {exc}") from None
        self._apply(candidate, manifest, state)
        barrier(self._ctx)
        seconds = time.perf_counter() - started
        self.last_step = manifest.step
        self._events.emit(
            "restore", step=manifest.step, world_size=self._ctx.world_size, seconds=seconds,
            checkpoint=name, saved_world_size=manifest.world_size,
        )
        if self._ctx.is_main:
            logger.info(
                "resumed from %s (step %d, saved at world size %d) in %.2f s",
                name, manifest.step, manifest.world_size, seconds,
            )
        return manifest.step

    def _select(self) -> tuple[Candidate, Manifest, dict[str, Any]] | None:
        """Rank 0: the newest checkpoint that verifies and loads; corrupt newer ones are moved aside."""
        candidates = self.store.committed()
        bad: list[tuple[Candidate, str]] = []
        for candidate in candidates:
            try:
                manifest, state = self.store.load(candidate, map_location=self._ctx.device)
            except CorruptCheckpoint as exc:
                logger.warning("checkpoint %s is corrupt (%s); trying the previous one", candidate.path, exc)
                bad.append((candidate, str(exc)))
                continue
            for corrupt, _ in bad:
                moved = self.store.quarantine(corrupt)
                logger.warning("moved corrupt checkpoint %s aside to %s", corrupt.name, moved.name)
            return candidate, manifest, state
        if bad:
            raise CheckpointError(
                f"no checkpoint in {self.store.root} verifies ({len(bad)} corrupt, newest: {bad[0][1]}); "
                "move them away to start from scratch"
            )
        return None

    def _apply(self, candidate: Candidate, manifest: Manifest, state: dict[str, Any]) -> None:
        """Check everything fits, then load it; nothing changes if a check fails."""
        model_state = state[MODEL_FILE]
        optimizer_state = state[OPTIMIZER_FILE]
        trainer = state[TRAINER_FILE]
        compat.check_model(candidate.name, self._model.state_dict(), model_state)
        compat.check_optimizer(candidate.name, self._optimizer, optimizer_state)
        sampler_state = trainer["sampler"]
        if int(sampler_state["num_samples"]) != self._sampler.num_samples or int(sampler_state["seed"]) != self._sampler.seed:
            raise CheckpointMismatchError(
                f"checkpoint {candidate.name} is for another data set or seed: {sampler_state['num_samples']} samples "
                f"with seed {sampler_state['seed']} there, {self._sampler.num_samples} with seed {self._sampler.seed} here"
            )
        if (trainer["scaler"] is None) != (self._scaler is None):
            raise CheckpointMismatchError(
                f"checkpoint {candidate.name} was saved {'without' if trainer['scaler'] is None else 'with'} a grad scaler"
            )
        saved_extra = trainer.get("extra", {})  # checkpoints before extra state have none
        if set(saved_extra) != set(self._extra):
            raise CheckpointMismatchError(
                f"checkpoint {candidate.name} holds extra state {sorted(saved_extra)}, this run registers "
                f"{sorted(self._extra)}; register the same objects to resume"
            )

        for name, obj in self._extra.items():  # first: the user's code may refuse the state
            try:
                obj.load_state_dict(saved_extra[name])
            except Exception as exc:  # noqa: BLE001 - whatever it raises is one line naming the object
                raise CheckpointMismatchError(
                    f"checkpoint {candidate.name}: extra state {name!r} does not load ({type(exc).__name__}: {exc})"
                ) from None
        self._model.load_state_dict(model_state)
        self._optimizer.load_state_dict(optimizer_state)
        if self._scheduler is not None and trainer["scheduler"] is not None:
            self._scheduler.load_state_dict(trainer["scheduler"])
        if self._scaler is not None:
            self._scaler.load_state_dict(trainer["scaler"])
        self._sampler.load_state_dict(sampler_state)
        rng_states = trainer["rng"]
        if self._ctx.rank < len(rng_states):
            set_rng_state(rng_states[self._ctx.rank], self._ctx.device)
        else:
            seed_all(self._seed * _RESEED_STRIDE + manifest.step * 7919 + self._ctx.rank, self._ctx.device)

    # -- save ------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return self.enabled and self.every > 0 and step % self.every == 0

    def maybe_save(self, step: int) -> None:
        """Save when `step` is a multiple of `every`; report saves that finished meanwhile."""
        if self.due(step):
            self.save(step)
        elif self._ctx.is_main:
            self._collect(block=False)

    def save(self, step: int, reason: str = "periodic") -> None:
        """Start saving the state as of now (a collective); returns once the state is copied.

        A periodic save while the previous one is still being written waits for
        it one `wait_slice` at most, then is skipped (an event says so); once
        one was skipped, later ones skip at once until a save keeps up again, so
        slow storage costs skipped saves, not steps, and never nears the
        watchdog or collective timeouts. A final or preemption save first waits,
        within `timeout`, for the one in flight.
        """
        if not self.enabled:
            return
        if reason == "periodic":
            if step == self.last_step or self._still_writing(step):
                return
        else:
            self.flush()  # the one in flight first: at most one save at a time
            # A step already saved is not saved again, unless that save failed.
            if step == self.last_step and not self._share_flag(self._last_save_failed):
                return
        started, wall_started = time.perf_counter(), time.time()
        # Every rank checks the extra state, so a bad one fails everywhere at this step, not on rank 0 alone.
        extra = {name: plain_state(name, obj.state_dict()) for name, obj in self._extra.items()}
        rng_states = self._gather_rng()
        self.last_step = step
        if not self._ctx.is_main:
            return
        self._prepare()
        now = copy_now(
            {"trainer": self._trainer_state(step, rng_states, extra), "buffers": dict(self._model.named_buffers())},
            self._pool, self._ctx.device, self._copy_stream,
        )
        record = _SaveRecord(
            step, reason, wall_started, 0.0, now["trainer"], now["buffers"],
            DeferredCopy(self._ctx.device, self._copy_stream),
        )
        self._in_flight = record
        self._writer.submit(lambda: self._write(record))
        record.blocking_seconds += time.perf_counter() - started

    def _still_writing(self, step: int) -> bool:
        """Whether rank 0 is still writing the previous save (a collective: every rank skips alike)."""
        busy = False
        if self._ctx.is_main:
            self._collect(block=False)
            if self._in_flight is None:
                self._storage_behind = False  # the last save kept up with the interval
            elif not self._storage_behind:
                # Nearly done is worth a short wait (one slice); after one that was not,
                # skip at once until a save keeps up again, so slow storage costs no steps.
                try:
                    self._collect(block=True, timeout=self._wait_slice)
                except TimeoutError:
                    self._storage_behind = True
            busy = self._in_flight is not None
        busy = self._share_flag(busy)
        if busy and self._ctx.is_main:
            writing = self._in_flight.step if self._in_flight is not None else None
            logger.warning(
                "skipping the checkpoint of step %d: the one of step %s is still being written (slow storage?)",
                step, writing,
            )
            self._events.emit("checkpoint_skipped", step=step, world_size=self._ctx.world_size, writing=writing)
        return busy

    @property
    def must_stop(self) -> bool:
        """Rank 0: `max_failures` periodic saves failed in a row (`stop_reason` says why)."""
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        return self._stop_reason

    def flush(self) -> None:
        """Wait until every save is committed or failed, on every rank (a collective).

        Rank 0 waits in slices of `wait_slice` seconds with a short collective
        after each, so slow storage never trips the collective timeout; after
        `timeout` seconds it gives up. Raises `CheckpointStorageError` on every
        rank when a final or preemption save failed or did not commit in time.
        """
        if not self.enabled:
            return
        deadline = time.monotonic() + self.timeout
        while True:
            writing = False
            if self._ctx.is_main:
                remaining = deadline - time.monotonic()
                try:
                    self._collect(block=True, timeout=max(0.0, min(self._wait_slice, remaining)))
                except TimeoutError:
                    if remaining > self._wait_slice:
                        writing = True
                    else:
                        self._fatal = self._fatal or self._timed_out()
            if not self._share_flag(writing):
                break
        fatal = self._share_message(self._fatal)
        if fatal is not None:
            raise CheckpointStorageError(fatal)

    def _timed_out(self) -> str:
        record = self._in_flight
        what = f"the {record.reason} checkpoint of step {record.step}" if record else "a checkpoint"
        return (
            f"{what} did not commit within {self.timeout:g} s (--ckpt-timeout): {self.store.root} is too slow "
            f"or hung; {self._newest_committed()}"
        )

    def _share_flag(self, flag: bool) -> bool:
        """Rank 0's `flag` on every rank."""
        if not self._ctx.distributed:
            return flag
        tensor = torch.tensor([int(flag)], dtype=torch.int32)
        dist.broadcast(tensor, src=0, group=control_group())
        return bool(tensor.item())

    def _share_message(self, message: str | None) -> str | None:
        """Rank 0's `message` on every rank (two collectives only when there is one)."""
        if not self._share_flag(message is not None):
            return None
        if not self._ctx.distributed:
            return message
        box: list[Any] = [message]
        dist.broadcast_object_list(box, src=0, group=control_group())
        return str(box[0])

    def share_stop_reason(self) -> str:
        """Rank 0's `stop_reason` on every rank (a collective, after a vote said to stop)."""
        return self._share_message(self._stop_reason) or "checkpoint saves keep failing"

    def close(self) -> None:
        """Commit what is in flight (waiting at most `timeout`) and detach from the optimizer;
        safe on error paths, where a failed save is only reported."""
        try:
            if self._ctx.is_main and self._in_flight is not None:
                try:
                    self._collect(block=True, timeout=self.timeout)
                except TimeoutError:
                    logger.warning("%s", self._timed_out())
        finally:
            try:
                self._writer.close(timeout=0 if self._writer.busy else None)
            except TimeoutError:
                pass  # reported above; the daemon thread finishes or dies with the process
            finally:
                if self._hook is not None:
                    self._hook.remove()
                    self._hook = None

    def _prepare(self) -> None:
        if not self._prepared:
            self.store.prepare()
            self._prepared = True

    def _gather_rng(self) -> list[dict[str, Any]]:
        mine = get_rng_state(self._ctx.device)
        if not self._ctx.distributed:
            return [mine]
        gathered: list[Any] = [None] * self._ctx.world_size if self._ctx.is_main else []
        # gather_object pickles in memory between trusted peers; the file holds plain types only.
        dist.gather_object(mine, gathered if self._ctx.is_main else None, dst=0, group=control_group())
        return gathered

    def _trainer_state(self, step: int, rng_states: list[dict[str, Any]], extra: dict[str, Any]) -> dict[str, Any]:
        return {
            "step": step,
            "world_size": self._ctx.world_size,
            "sampler": self._sampler.state_dict(),
            "scheduler": self._scheduler.state_dict() if self._scheduler is not None else None,
            "scaler": self._scaler.state_dict() if self._scaler is not None else None,
            "extra": extra,
            "rng": rng_states,
        }

    def _wait_sources_free(self) -> None:
        """Optimizer step pre-hook: the step may change parameters once the save has read them."""
        record = self._in_flight
        if record is None or record.sources_released:
            return
        started = time.perf_counter()
        record.deferred.wait_sources_free()
        record.sources_released = True
        record.blocking_seconds += time.perf_counter() - started

    def _live_state(self, record: _SaveRecord) -> dict[str, Any]:
        """Writer thread: model and optimizer state dicts, buffers taken from the save's own copies.

        Safe off the loop's thread because parameters and optimizer state (and
        the learning rates the scheduler sets right after a step) change only
        in an optimizer step, which the pre-hook holds until this is copied.
        """
        model_state = self._model.state_dict()
        for key, copy in record.buffers.items():
            if key in model_state:
                model_state[key] = copy
        return {MODEL_FILE: model_state, OPTIMIZER_FILE: self._optimizer.state_dict()}

    def _write(self, record: _SaveRecord) -> _Outcome:
        """Writer thread: copy the rest, serialise, fsync, commit. A storage failure is an
        outcome (the loop goes on), not an exception; anything else is a bug and raises."""
        tree = record.deferred.run(
            lambda: self._live_state(record), self._pool, keep={id(t) for t in record.buffers.values()}
        )
        tree[TRAINER_FILE] = record.trainer
        trainer, sampler = record.trainer, record.trainer["sampler"]

        def describe(files: dict[str, dict[str, Any]]) -> Manifest:
            return Manifest(
                step=record.step, epoch=int(sampler["epoch"]), consumed=int(sampler["consumed"]),
                world_size=int(trainer["world_size"]), files=files, created=time.time(),
                reason=record.reason, run_id=self._ctx.run_id, versions=versions(),
            )

        try:
            self.store.commit(
                record.step,
                tree,
                describe=describe,
                before_commit=lambda: self._faults.at("before_commit", record.step),
                mid_write=lambda: self._faults.at("during_write", record.step),
            )
        except SaveFailed as exc:
            return _Outcome(time.time(), str(exc))
        except OSError as exc:  # after the commit's own cleanup: renaming, retiring
            return _Outcome(time.time(), f"cannot commit step {record.step} in {self.store.root}: {describe_failure(exc)}")
        return _Outcome(time.time(), None)

    def _collect(self, *, block: bool, timeout: float | None = None) -> None:
        """Rank 0: report the save in flight if it has finished (waiting for it if `block`,
        at most `timeout` seconds: `TimeoutError` then, and it stays in flight)."""
        record = self._in_flight
        if record is None or (not block and self._writer.busy):
            return
        outcome: _Outcome = self._writer.wait(timeout)
        self._in_flight = None
        if outcome.error is not None:
            self._on_failure(record, outcome.error)
        else:
            self._on_commit(record, outcome.finished)

    def _on_commit(self, record: _SaveRecord, committed_at: float) -> None:
        self._failures_in_a_row = 0
        self._last_save_failed = False
        seconds = committed_at - record.started
        self.history.append(
            {"step": record.step, "seconds": seconds, "blocking_seconds": record.blocking_seconds}
        )
        self._events.emit(
            "checkpoint", step=record.step, world_size=self._ctx.world_size, time=committed_at,
            seconds=seconds, blocking_seconds=record.blocking_seconds, reason=record.reason,
            path=str(self.store.root / checkpoint_name(record.step)),
        )
        logger.debug("checkpoint at step %d committed in %.2f s", record.step, seconds)

    def _on_failure(self, record: _SaveRecord, error: str) -> None:
        """A save that did not commit: a warning, an event and a metric; the job stops only
        after `max_failures` periodic ones in a row, or when it was the final or preemption save."""
        self._failures_in_a_row += record.reason == "periodic"
        self._last_save_failed = True
        self._events.emit(
            "checkpoint_failed", step=record.step, world_size=self._ctx.world_size, reason=record.reason,
            error=error, failures_in_a_row=self._failures_in_a_row,
        )
        newest = self._newest_committed()
        if record.reason != "periodic":
            self._fatal = f"the {record.reason} checkpoint of step {record.step} failed: {error}; {newest}"
            return
        if self._failures_in_a_row >= self.max_failures:
            self._stop_reason = (
                f"{self._failures_in_a_row} checkpoints in a row failed (--ckpt-max-failures), the last: {error}; {newest}"
            )
            return  # the next step's vote stops every rank; its error is the one line
        logger.warning(
            "checkpoint of step %d failed (%d of %d in a row before the job stops): %s; training goes on",
            record.step, self._failures_in_a_row, self.max_failures, error,
        )

    def _newest_committed(self) -> str:
        try:
            committed = self.store.committed()
        except OSError:
            committed = []
        if not committed:
            return "no checkpoint was committed"
        return f"the newest committed checkpoint, {committed[0].path}, is intact"
