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
- Every rank writes its part, in parallel, on its own writer thread, through
  torch.distributed.checkpoint on a gloo group of its own (sharded.py): its
  shards of sharded (FSDP2) tensors and the replicated tensors `owners` gives
  it, so each byte is written once. Rank 0 then writes trainer.pt (sampler,
  schedule, scaler, extra state, optimizer settings, every rank's RNG states,
  gathered) and the manifest, and commits the directory by one rename.
- `extra` objects (anything with `state_dict`/`load_state_dict`: an EMA, a
  data pipeline, counters) are saved by name beside the sampler, from rank 0,
  copied when the save is asked for; like the model they must hold the same
  state on every rank. Their state dicts must be tensors and plain values
  (checkpoints load with `weights_only=True`).
- `restore` loads the newest checkpoint that verifies, before the first step.
  Rank 0 reads the manifest, metadata and trainer.pt and checks the
  checkpoint fits this model, optimizer and data (`CheckpointMismatchError`
  before anything changes); every rank then reads only the chunks it needs
  into host buffers (each sharded tensor resharded to this world size; each
  replicated one read by one rank and broadcast), checking every chunk's
  crc32c as it reads, so each byte is read and verified once per job. Only
  when every rank read everything is the live state changed. A corrupt one is
  reported with a warning naming it and the previous one is tried; corrupt
  ones are moved aside once an older one restored (none verifies: an error,
  and nothing is moved); reading longer than `restore_timeout` is a
  `CheckpointStorageError`.
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

import atexit
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import crc32c
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.utils import CheckpointException

from elastic.chaos import FaultInjector
from elastic.checkpoint import compat, parts, sharded
from elastic.checkpoint import state as live_state
from elastic.checkpoint.memory import KeeperAddress, MemorySnapshots, PartFetchError
from elastic.checkpoint.snapshot import BufferPool, DeferredCopy, copy_now, dtensor_like
from elastic.checkpoint.store import (
    Candidate,
    CheckpointStore,
    Manifest,
    SaveFailed,
    WriterIdentity,
    checkpoint_name,
    describe_failure,
    versions,
)
from elastic.checkpoint.writer import BackgroundWriter
from elastic.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointStorageError,
    CorruptCheckpoint,
    RestoreTimedOut,
    UsageError,
)
from elastic.events import EventLog
from elastic.rng import get_rng_state, seed_all, set_rng_state
from elastic.runtime import WorkerContext, barrier, control_group
from elastic.sampler import ElasticSampler

logger = logging.getLogger(__name__)

MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
"""Format 1 only: model and optimizer state dicts, written by rank 0 (format 2 shards them)."""
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
        f"{_state_label(name)}: state_dict(){path} is a {type(tree).__module__}.{type(tree).__qualname__}; "
        "checkpoints hold tensors and plain values only (int, float, str, lists, dicts: convert it)"
    )


def _state_label(name: str) -> str:
    return f"the {name}" if name in ("scheduler", "scaler", "optimizer") else f"extra state {name!r}"


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
        restore_timeout: float = 600.0,
        wait_slice: float = 5.0,
        snapshot_every: int = 0,
    ) -> None:
        self._ctx = ctx
        self.enabled = directory is not None
        self.store = CheckpointStore(directory if directory is not None else ".", keep=keep)
        live_state.check_supported(model, optimizer)
        self._model = model
        self._optimizer = optimizer
        self._sampler = sampler
        self._scheduler = scheduler
        self._scaler = scaler
        self._extra = dict(extra or {})
        for name, obj in self._extra.items():
            if not callable(getattr(obj, "state_dict", None)) or not callable(getattr(obj, "load_state_dict", None)):
                raise TypeError(f"extra state {name!r} ({type(obj).__name__}) has no state_dict/load_state_dict")
        if max_failures < 1 or timeout <= 0 or restore_timeout <= 0 or wait_slice <= 0:
            raise UsageError(
                f"max_failures={max_failures} must be 1 or more, timeout={timeout}, restore_timeout={restore_timeout} "
                "and wait_slice above 0"
            )
        self.every = every
        self.max_failures = max_failures
        """Periodic saves that may fail in a row before the job stops (`CheckpointStorageError`)."""
        self.timeout = timeout
        """Seconds a final or preemption save may take to commit, waiting for one in flight included."""
        self.restore_timeout = restore_timeout
        """Seconds reading a checkpoint may take on restore before the job stops (`CheckpointStorageError`)."""
        self._wait_slice = wait_slice
        self._events = events or EventLog(None, restart=ctx.restart_count)
        self._seed = seed
        self._writer = BackgroundWriter(drain_timeout=timeout)
        self._faults = FaultInjector(ctx.rank, ctx.restart_count)
        self._pool = BufferPool(pin_memory=ctx.device.type == "cuda")
        self._copy_stream = torch.cuda.Stream(ctx.device) if ctx.device.type == "cuda" else None
        self._group: dist.ProcessGroup | None = None
        self._restore_group: dist.ProcessGroup | None = None
        if self.enabled and ctx.distributed:
            # Saves run their collectives on the writer threads: a group of their own, never the loop's.
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout + 60))
            # A restore's collectives wait no longer than its deadline for a rank stuck reading.
            self._restore_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=restore_timeout))
        self._identity = WriterIdentity.new(ctx.run_id) if ctx.is_main else None
        self._closing = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="checkpoint-heartbeat", daemon=True)
        self._tag = ""  # shared by every rank at restore: names the temporary directory of each save
        self._layout = live_state.Layout(model, optimizer)
        self._mine_keys: frozenset[str] = frozenset()  # writer thread: the keys of this rank's share
        self._in_flight: _SaveRecord | None = None
        self._storage_behind = False  # rank 0: a periodic save was skipped and none kept up since
        self._failures_in_a_row = 0  # rank 0: periodic saves failed since the last commit
        self._last_save_failed = False  # rank 0: the newest save did not commit
        self._stop_reason: str | None = None  # rank 0: why the job must stop (saves keep failing)
        self._fatal: str | None = None  # rank 0: a final or preemption save that did not commit
        self._prepared = False  # directory claimed, created and stale temporaries removed (rank 0)
        self.last_step: int | None = None
        """The newest step saved or restored: a save at this step again is skipped."""
        self.history: list[dict[str, float]] = []
        """Per committed save: step, seconds (start to commit), blocking_seconds (rank 0)."""
        self.restored_bytes = 0
        """Bytes of tensor data this rank read on restore (each chunk it needed, once)."""
        self.fetched_bytes = 0
        """Of those, bytes this rank fetched from other nodes' snapshot keepers (with the blocks around them)."""
        self._hook = None
        if self.enabled:
            # Parameters and optimizer state change only in optimizer.step(): their copy
            # may run until then, and this hook holds the step until it has.
            self._hook = optimizer.register_step_pre_hook(lambda *_: self._wait_sources_free())
        self._memory: MemorySnapshots | None = None
        self._snapshot_copy: DeferredCopy | None = None
        self._snapshot_pool = BufferPool(pin_memory=False)
        if self.enabled and snapshot_every > 0:
            keeper = KeeperAddress.from_env()
            if keeper is None:
                if ctx.is_main:
                    logger.info(
                        "in-memory snapshots are off: no snapshot keeper runs on this node (start the job with "
                        "torchrevive-run for them); a failure resumes from the last checkpoint on disk"
                    )
            else:
                self._memory = MemorySnapshots(
                    ctx, keeper, every=snapshot_every, ckpt_dir=str(self.store.root.resolve()), keep=keep,
                    fault=self._faults.at,
                )

    # -- restore ---------------------------------------------------------------

    def restore(self) -> int:
        """Load the newest good checkpoint on every rank; the step to continue from (0: none)."""
        if not self.enabled:
            return 0
        started = time.perf_counter()
        deadline = time.monotonic() + self.restore_timeout
        candidates: list[Candidate] = []
        box: list[Any] = [None, uuid.uuid4().hex[:8]]
        if self._ctx.is_main:
            try:
                self._prepare()  # a storage that refuses writes stops a restart here, before any training
                candidates = self.store.committed()
            except CheckpointError as exc:
                box[0] = exc  # every rank raises the same error
        self._broadcast_objects(box)
        if isinstance(box[0], CheckpointError):
            raise box[0]
        self._tag = box[1]
        if not self._all_ranks_ok(self._memory is not None, on_loop=True) and self._memory is not None:
            # Every rank takes the same path through the collectives below: one node without a
            # keeper turns the memory tier off everywhere.
            if self._ctx.is_main:
                logger.warning("in-memory snapshots are off: a node of this job has no snapshot keeper")
            self._memory.close(timeout=0)
            self._memory = None
        if self._memory is not None:
            self._memory.generation = self._tag
            newest_on_disk = candidates[0].step if candidates else -1
            restored = self._restore_from_memory(newest_on_disk, started, deadline)
            if restored is not None:
                return restored
        corrupt: list[str] = []
        bad: list[Candidate] = []  # rank 0: moved aside once an older one restores; all corrupt: none moves
        while True:
            offer = self._offer(candidates, corrupt, bad) if self._ctx.is_main else None
            offer = self._broadcast_object(offer)
            if isinstance(offer, CheckpointError):
                raise offer
            if offer is None:
                break
            name, manifest, trainer, tensors_json = offer
            candidate = Candidate(name, manifest.step, self.store.root / name)
            try:
                if manifest.format == 1:
                    self._restore_format1(candidate, manifest)
                else:
                    self._restore_sharded(candidate, manifest, trainer, tensors_json, deadline)
            except CorruptCheckpoint as exc:
                reason = str(exc)
                if self._ctx.is_main:
                    logger.warning("checkpoint %s is corrupt (%s); trying the previous one", candidate.path, reason)
                    corrupt.append(reason)
                    bad.append(candidate)
                    candidates = [c for c in candidates if c.name != name]
                continue
            if self._ctx.is_main:
                self._quarantine(bad)
            return self._restored(name, manifest, started, source="disk")
        barrier(self._ctx)
        logger.info("no checkpoint in %s: starting at step 0", self.store.root)
        return 0

    def _offer(self, candidates: list[Candidate], corrupt: list[str], bad: list[Candidate]) -> Any:
        """Rank 0: the next candidate as (name, manifest, trainer state, tensors.json text), after
        checking it fits this job; None when none is left; a `CheckpointError` for every rank to raise.
        Corrupt candidates are added to `corrupt` (why) and `bad`, not moved."""
        try:
            for candidate in list(candidates):
                try:
                    manifest = self.store.read_checked_manifest(candidate)
                    self.store.check_sizes(candidate, manifest)
                    trainer = self.store.load_state_file(candidate, manifest, TRAINER_FILE)
                    tensors_json = None
                    if manifest.format >= 2:
                        metadata = self.store.tensor_metadata(candidate, manifest)
                        tensors_json = sharded.metadata_to_json(metadata)
                        self._check_sharded(candidate.name, metadata, trainer)
                    self._check_trainer(candidate.name, trainer)
                except CorruptCheckpoint as exc:
                    logger.warning("checkpoint %s is corrupt (%s); trying the previous one", candidate.path, exc)
                    corrupt.append(str(exc))
                    bad.append(candidate)
                    candidates.remove(candidate)
                    continue
                self.store.check_room(manifest.total_bytes)  # the next save would not fit
                return candidate.name, manifest, trainer, tensors_json
        except CheckpointError as exc:
            return exc
        except OSError as exc:
            return CheckpointStorageError(f"cannot read checkpoints in {self.store.root}: {describe_failure(exc)}")
        if corrupt:
            return CheckpointError(
                f"no checkpoint in {self.store.root} verifies ({len(corrupt)} corrupt, newest: {corrupt[0]}); "
                "move them away to start from scratch"
            )
        return None

    def _quarantine(self, bad: list[Candidate]) -> None:
        """Rank 0, once an older checkpoint restored: move the corrupt newer ones aside (a failure
        to move one is a warning: the restore succeeded)."""
        for candidate in bad:
            try:
                moved = self.store.quarantine(candidate)
            except OSError as exc:
                logger.warning("cannot move corrupt checkpoint %s aside: %s", candidate.path, describe_failure(exc))
                continue
            logger.warning("moved corrupt checkpoint %s aside to %s", candidate.name, moved.name)

    def _check_sharded(self, name: str, metadata: Any, trainer: dict[str, Any]) -> None:
        """The saved tensors and optimizer groups fit the live model and optimizer (before anything changes)."""
        saved = sharded.tensor_shapes(metadata)
        live = {
            key: value for key, value in live_state.live_tensors(self._model, self._optimizer).items()
            if key.startswith(live_state.MODEL_PREFIX)
        }
        live_state.check_shapes(name, live, saved, live_state.MODEL_PREFIX)
        if trainer.get("aliases", {}) != live_state.tied_aliases(self._model):
            raise CheckpointMismatchError(
                f"checkpoint {name} is for another model: its tied weights {trainer.get('aliases', {})} differ from "
                f"this model's {live_state.tied_aliases(self._model)}"
            )
        if set(trainer.get("module_extra", {})) != set(live_state.module_extra_state(self._model)):
            raise CheckpointMismatchError(
                f"checkpoint {name} is for another model: modules with extra state differ "
                f"({sorted(trainer.get('module_extra', {}))} there, {sorted(live_state.module_extra_state(self._model))} here)"
            )
        params = dict(self._model.named_parameters())
        for key, (shape, _) in saved.items():
            if not key.startswith(live_state.OPTIM_PREFIX):
                continue
            param_name = key[len(live_state.OPTIM_PREFIX) :].rsplit("/", 1)[0]
            param = params.get(param_name)
            if param is None:
                raise CheckpointMismatchError(
                    f"checkpoint {name} is for another model: it has optimizer state for {param_name}, which this "
                    "model lacks"
                )
            if len(shape) == param.dim() and shape != param.shape:
                raise CheckpointMismatchError(
                    f"checkpoint {name} is for another model: optimizer state {key[len(live_state.OPTIM_PREFIX):]} "
                    f"has shape {list(shape)} there and {list(param.shape)} here"
                )
        live_state.check_groups(name, self._optimizer, self._model, trainer["optimizer"])

    def _check_trainer(self, name: str, trainer: dict[str, Any]) -> None:
        sampler_state = trainer["sampler"]
        if int(sampler_state["num_samples"]) != self._sampler.num_samples or int(sampler_state["seed"]) != self._sampler.seed:
            raise CheckpointMismatchError(
                f"checkpoint {name} is for another data set or seed: {sampler_state['num_samples']} samples "
                f"with seed {sampler_state['seed']} there, {self._sampler.num_samples} with seed {self._sampler.seed} here"
            )
        if (trainer["scaler"] is None) != (self._scaler is None):
            raise CheckpointMismatchError(
                f"checkpoint {name} was saved {'without' if trainer['scaler'] is None else 'with'} a grad scaler"
            )
        saved_extra = trainer.get("extra", {})  # checkpoints before extra state have none
        if set(saved_extra) != set(self._extra):
            raise CheckpointMismatchError(
                f"checkpoint {name} holds extra state {sorted(saved_extra)}, this run registers "
                f"{sorted(self._extra)}; register the same objects to resume"
            )

    def _restore_sharded(
        self, candidate: Candidate, manifest: Manifest, trainer: dict[str, Any], tensors_json: str, deadline: float,
        *, source: sharded.ChunkSource | None = None,
    ) -> None:
        """Every rank: read its part into host buffers, then (all of it read) change the live state.

        Raises `CorruptCheckpoint` on every rank when any rank's chunk fails its check.
        `source`: where the bytes come from instead of the checkpoint's files (snapshot parts).
        """
        metadata = sharded.metadata_from_json(tensors_json)
        saved = sharded.tensor_shapes(metadata)
        live = live_state.live_tensors(self._model, self._optimizer)
        params = dict(self._model.named_parameters())
        targets: dict[str, torch.Tensor] = {}
        plain: dict[str, tuple[torch.Size, torch.dtype]] = {}
        for key, (shape, dtype) in saved.items():
            like = live.get(key)
            if like is None:  # optimizer state: none exists yet; its parameter says how it is sharded
                param = params[key[len(live_state.OPTIM_PREFIX) :].rsplit("/", 1)[0]]
                like = param if param.shape == shape else None
            if like is not None and isinstance(like, sharded.DTensor):
                targets[key] = live_state.host_buffer_like(like, dtype=dtype)
            else:
                plain[key] = (shape, dtype)
        owner = live_state.owners(
            {key: _numel(shape) * dtype.itemsize for key, (shape, dtype) in plain.items()}, self._ctx.world_size
        )
        for key, (shape, dtype) in plain.items():
            if owner[key] == self._ctx.rank:
                targets[key] = torch.empty(shape, dtype=dtype)
        timed_out = RestoreTimedOut(
            f"restoring {candidate.name} from {self.store.root} did not finish within "
            f"{self.restore_timeout:g} s (--ckpt-restore-timeout): the storage is too slow or hung"
        )
        # Read on a thread: a read stuck in the kernel (a hung mount) cannot be interrupted,
        # but this rank can stop waiting for it at the deadline.
        outcome: dict[str, Any] = {}

        def read() -> None:
            try:
                outcome["bytes"] = sharded.load_tensors(
                    targets, candidate.path, metadata, group=self._restore_group, deadline=deadline,
                    after_first_chunk=lambda: self._faults.at("during_read", manifest.step), source=source,
                )
            except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
                outcome["error"] = exc

        reader = threading.Thread(target=read, name="checkpoint-restore", daemon=True)
        reader.start()
        reader.join(max(0.0, deadline - time.monotonic()) + 5.0)  # peers' own deadlines fire first
        if reader.is_alive():
            raise timed_out
        if "error" in outcome:
            error = sharded.first_error(outcome["error"])
            if isinstance(error, CorruptCheckpoint):
                raise error
            if isinstance(error, PartFetchError):  # every rank alike, whatever its clock says
                raise CheckpointStorageError(f"cannot read {candidate.name} from the other nodes: {error}")
            if isinstance(error, TimeoutError) or (_is_timeout(error) and time.monotonic() >= deadline):
                raise timed_out
            if isinstance(error, OSError):
                raise CheckpointStorageError(f"cannot read {candidate.name} in {self.store.root}: {describe_failure(error)}")
            raise outcome["error"]  # a peer died mid-restore: a failure like any other, which the launcher restarts
        self.restored_bytes = outcome["bytes"]
        # Everything read and verified on every rank: only now does live state change.
        self._apply_extra(manifest, trainer)
        self._apply_tensors(live, targets, plain, owner, trainer["optimizer"])
        live_state.set_module_extra_state(self._model, trainer.get("module_extra", {}))
        self._apply_trainer(manifest, trainer)

    def _apply_tensors(
        self,
        live: dict[str, torch.Tensor],
        targets: dict[str, torch.Tensor],
        plain: dict[str, tuple[torch.Size, torch.dtype]],
        owner: dict[str, int],
        optimizer_settings: dict[str, Any],
    ) -> None:
        optimizer_tensors: dict[str, torch.Tensor] = {}
        params = dict(self._model.named_parameters())
        with torch.no_grad():
            for key in sorted(set(targets) | set(plain)):
                is_model = key.startswith(live_state.MODEL_PREFIX)
                if key not in plain:  # a shard of this rank's, resharded by the load
                    if is_model:
                        live[key].to_local().copy_(targets.pop(key).to_local())
                    else:
                        param = params[key[len(live_state.OPTIM_PREFIX) :].rsplit("/", 1)[0]]
                        host = targets.pop(key).to_local()
                        optimizer_tensors[key] = dtensor_like(host.to(param.device), param)
                    continue
                shape, dtype = plain[key]
                mine = owner[key] == self._ctx.rank
                if is_model:
                    dest = live[key]
                else:
                    param = params[key[len(live_state.OPTIM_PREFIX) :].rsplit("/", 1)[0]]
                    on_device = param.device.type == "cuda" and len(shape) > 0
                    if mine and not on_device:  # the host buffer read into is the state itself
                        dest = targets[key]
                    else:
                        dest = torch.empty(shape, dtype=dtype, device=param.device if on_device else "cpu")
                    optimizer_tensors[key] = dest
                if mine:
                    source = targets.pop(key)
                    if source is not dest:
                        dest.copy_(source)
                self._broadcast_tensor(dest, owner[key])
        self._optimizer.load_state_dict(
            live_state.optimizer_state_dict(self._model, self._optimizer, optimizer_tensors, optimizer_settings)
        )

    def _broadcast_tensor(self, tensor: torch.Tensor, src: int) -> None:
        """`src`'s `tensor` on every rank: on the device (NCCL) for GPU tensors, else on the checkpoint group."""
        if not self._ctx.distributed:
            return
        if tensor.device.type == "cuda":
            dist.broadcast(tensor, src=src)
        else:
            dist.broadcast(tensor, src=src, group=self._restore_group)

    def _restore_format1(self, candidate: Candidate, manifest: Manifest) -> None:
        """A checkpoint of torchrevive 0.1 (rank 0's whole files): every rank reads them itself."""
        if any(isinstance(t, sharded.DTensor) for t in self._model.state_dict().values()):
            raise CheckpointError(
                f"checkpoint {candidate.path} is in format 1 (one file per state, written by rank 0); a sharded "
                "(FSDP2) model cannot load it: resume it once without FSDP, which writes the sharded format"
            )
        state = {}
        for file_name in (MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE):
            state[file_name] = self.store.load_state_file(candidate, manifest, file_name, map_location=self._ctx.device)
        compat.check_model(candidate.name, self._model.state_dict(), state[MODEL_FILE])
        compat.check_optimizer(candidate.name, self._optimizer, state[OPTIMIZER_FILE])
        self._check_trainer(candidate.name, state[TRAINER_FILE])
        self._apply_extra(manifest, state[TRAINER_FILE])
        self._model.load_state_dict(state[MODEL_FILE])
        self._optimizer.load_state_dict(state[OPTIMIZER_FILE])
        self._apply_trainer(manifest, state[TRAINER_FILE])

    def _apply_extra(self, manifest: Manifest, trainer: dict[str, Any]) -> None:
        """First of all: the user's code may refuse the state, and then nothing else has changed."""
        for name, obj in self._extra.items():
            try:
                obj.load_state_dict(trainer.get("extra", {})[name])
            except Exception as exc:  # noqa: BLE001 - whatever it raises is one line naming the object
                raise CheckpointMismatchError(
                    f"checkpoint step_{manifest.step:08d}: extra state {name!r} does not load ({type(exc).__name__}: {exc})"
                ) from None

    def _apply_trainer(self, manifest: Manifest, trainer: dict[str, Any]) -> None:
        if self._scheduler is not None and trainer["scheduler"] is not None:
            self._scheduler.load_state_dict(trainer["scheduler"])
        if self._scaler is not None:
            self._scaler.load_state_dict(trainer["scaler"])
        self._sampler.load_state_dict(trainer["sampler"])
        rng_states = trainer["rng"]
        if self._ctx.rank < len(rng_states):
            set_rng_state(rng_states[self._ctx.rank], self._ctx.device)
        else:
            seed_all(self._seed * _RESEED_STRIDE + manifest.step * 7919 + self._ctx.rank, self._ctx.device)

    def _restored(self, name: str, manifest: Manifest, started: float, *, source: str) -> int:
        barrier(self._ctx)
        seconds = time.perf_counter() - started
        # A snapshot's step is not on disk yet (the keeper may still be writing it): a final
        # save at this very step must not be skipped as already saved.
        self.last_step = manifest.step if source == "disk" else None
        if source == "disk":
            self.fetched_bytes = 0
        read = torch.tensor([self.restored_bytes, self.fetched_bytes], dtype=torch.int64)
        if self._ctx.distributed:
            dist.all_reduce(read, group=control_group())
        redone = self._steps_redone(manifest.step)
        self._events.emit(
            "restore", step=manifest.step, world_size=self._ctx.world_size, seconds=seconds,
            checkpoint=name, saved_world_size=manifest.world_size, bytes_read=int(read[0]), source=source,
            **({"bytes_fetched": int(read[1])} if source != "disk" else {}),
            **({"redone": redone} if redone is not None else {}),
        )
        if self._ctx.is_main:
            logger.info(
                "resumed from %s%s (step %d, saved at world size %d) in %.2f s%s",
                name, {"disk": "", "memory": " in memory", "peer": " in a peer node's memory"}[source],
                manifest.step, manifest.world_size, seconds,
                f"; {redone} step(s) to redo" if redone is not None else "",
            )
        return manifest.step

    def _steps_redone(self, step: int) -> int | None:
        """Steps finished before the failure that the job trains again (the newest step any
        node's workers noted, less the restored one); None when no node noted any (a first start,
        or no keeper). A collective."""
        progress = self._memory.last_progress() if self._memory is not None else None
        newest = torch.tensor([-1 if progress is None else progress], dtype=torch.int64)
        if self._ctx.distributed:
            dist.all_reduce(newest, op=dist.ReduceOp.MAX, group=control_group())
        if self._memory is not None:
            self._memory.reset_progress(step)  # every node has read its notes
        return max(0, int(newest.item()) - step) if newest.item() >= 0 else None

    # -- restore from memory -----------------------------------------------------

    def _restore_from_memory(self, newest_on_disk: int, started: float, deadline: float) -> int | None:
        """Every rank: restore the newest snapshot every old rank's part of is in some node's memory,
        if it is at least as new as the newest checkpoint on disk; None (nothing changed) otherwise."""
        assert self._memory is not None
        memory = self._memory
        memory.connect()
        held = memory.inventory()
        gathered: list[Any] = [None] * self._ctx.world_size if self._ctx.is_main else []
        if self._ctx.distributed:
            dist.gather_object(held, gathered if self._ctx.is_main else None, dst=0, group=control_group())
        else:
            gathered = [held]
        plan = self._memory_plan(gathered, newest_on_disk) if self._ctx.is_main else None
        plan = self._broadcast_object(plan)
        if plan is None:
            return None
        step, world_size, source, locations, trainer, tensors_json = plan
        name = f"the in-memory snapshot of step {step}"
        files = None
        why = None
        try:
            # Fetching from other nodes gets half the time left: the disk fallback needs the rest.
            now = time.monotonic()
            files = memory.gather_files(locations, self._tag, fetch_deadline=now + (deadline - now) / 2)
        except OSError as exc:
            why = f"rank {self._ctx.rank} could not get its parts: {describe_failure(exc)}"
        if not self._all_ranks_ok(why is None, on_loop=True):
            if self._ctx.is_main:
                logger.warning("%s cannot be restored (%s); restoring from disk", name, why or "another rank could not get its parts")
            self._remove(files.directory if files is not None else None)
            return None
        sampler = trainer["sampler"]
        manifest = Manifest(
            step=step, epoch=int(sampler["epoch"]), consumed=int(sampler["consumed"]), world_size=world_size,
            files={}, created=time.time(), reason="snapshot", run_id=self._ctx.run_id, versions=versions(),
        )
        try:
            self._restore_sharded(Candidate(name, step, files.directory), manifest, trainer, tensors_json, deadline, source=files)
        except (CorruptCheckpoint, CheckpointStorageError) as exc:  # every rank alike (DCP's collective)
            if isinstance(exc, RestoreTimedOut):
                raise
            if self._ctx.is_main:
                logger.warning("%s cannot be restored (%s); restoring from disk", name, exc)
            return None
        finally:
            self._remove(files.directory)
        self.fetched_bytes = files.bytes_fetched
        return self._restored(checkpoint_name(step), manifest, started, source=source)

    def _memory_plan(self, gathered: list[dict[str, Any]], newest_on_disk: int) -> Any:
        """Rank 0: (step, world size, source, locations, trainer, tensors.json) of the snapshot to
        restore, or None: the newest step whose every part some node holds, when it fits this job
        and is no older than the newest checkpoint on disk."""
        places: dict[tuple[int, int], dict[int, list[tuple[str, str, str, str]]]] = {}
        headers: dict[tuple[int, int], dict[int, parts.PartHeader]] = {}
        ckpt_dir = str(self.store.root.resolve())
        for node in gathered:
            for where, header in node["parts"]:
                if header.ckpt_dir != ckpt_dir:
                    continue  # another job's (one keeper may serve several in one process)
                # One plan takes parts of one generation (the restore their writers resumed from):
                # parts a dead timeline left at the same step never mix with the live one's.
                key = (header.step, header.world_size, str(header.extra.get("generation", "")))
                chosen_header = headers.setdefault(key, {}).setdefault(header.rank, header)
                if header.stem == chosen_header.stem:  # the file each rank reads is the header's own
                    places.setdefault(key, {}).setdefault(header.rank, []).append((node["node"], node["url"], where, header.stem))
        for (step, world_size, generation) in sorted(places, key=lambda k: (k[0], k[1]), reverse=True):
            if step < newest_on_disk:
                break
            found = places[(step, world_size, generation)]
            if set(found) != set(range(world_size)):
                continue
            name = f"the in-memory snapshot of step {step}"
            try:
                chosen = [headers[(step, world_size, generation)][rank] for rank in range(world_size)]
                metadata = parts.merged_metadata(chosen)
                trainer = parts.merged_trainer(chosen)
                self._check_sharded(name, metadata, trainer)
                self._check_trainer(name, trainer)
            except (CorruptCheckpoint, CheckpointMismatchError, KeyError) as exc:
                logger.warning("%s cannot be restored (%s); trying an older one", name, exc)
                continue
            # "memory": every part is where its own worker wrote it; "peer": some survive only as replicas.
            source = "memory" if all(any(p[2] == "local" for p in found[r]) for r in found) else "peer"
            return step, world_size, source, found, trainer, sharded.metadata_to_json(metadata)
        return None

    @staticmethod
    def _remove(directory: Any) -> None:
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    # -- save ------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return self.enabled and self.every > 0 and step % self.every == 0

    def maybe_save(self, step: int) -> None:
        """Save when `step` is a multiple of `every`; report saves that finished meanwhile; take
        the in-memory snapshot when one is due."""
        if self._memory is not None:
            self._memory.note_step(step)
        if self.due(step):
            self.save(step)
        else:
            self._collect(block=False)
        if self._memory is not None and self._memory.due(step):
            self.snapshot(step)

    def snapshot(self, step: int) -> None:
        """Copy the state of `step` into this node's shared memory (see memory.py). Not a
        collective: each rank copies its own share; the loop blocks only for the copy."""
        memory = self._memory
        if memory is None:
            return
        started = time.perf_counter()
        memory.wait_previous()  # at most one in flight: its buffers are reused now
        if memory.disabled is not None:
            return
        # What a weights-only load could not read back is refused at the first snapshot and at every
        # checkpoint (plain_state); checking it at every step would cost the loop for nothing.
        first = not memory.history
        extra = {name: plain_state(name, obj.state_dict()) if first else obj.state_dict() for name, obj in self._extra.items()}
        trainer = self._trainer_state(step, [get_rng_state(self._ctx.device)], extra, self._layout.settings(), check=first)
        layout = self._layout
        rank, world = self._ctx.rank, self._ctx.world_size
        if layout.sharded:
            # FSDP2 swaps its registered parameters in every forward: the share is taken now.
            mine = layout.share(layout.tensors(), rank, world)
            buffers = {k: v for k, v in mine.items() if k in layout.buffer_keys}

            def build() -> dict[str, torch.Tensor]:
                return mine
        else:
            # Every buffer is copied now (a forward changes them; they are small); which of them
            # and of the parameters this rank keeps is settled on the snapshot thread.
            buffers = {live_state.MODEL_PREFIX + name: b for name, b in self._model.named_buffers()}

            def build() -> dict[str, torch.Tensor]:
                return layout.share(layout.tensors(), rank, world)
        now = copy_now({"trainer": trainer, "buffers": buffers}, self._snapshot_pool, self._ctx.device, self._copy_stream)
        self._snapshot_copy = DeferredCopy(self._ctx.device, self._copy_stream)
        memory.submit(step, now["trainer"], now["buffers"], build, self._snapshot_copy)
        memory.blocking_seconds.append(time.perf_counter() - started)

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
        settings = plain_state("optimizer", self._layout.settings())
        rng_states = self._gather_rng()
        self.last_step = step
        if self._ctx.is_main:
            self._prepare()
        layout = self._layout
        if layout.sharded:
            # FSDP2 swaps the registered parameters in every forward: which tensors to save is
            # settled here, on the loop's thread, between steps.
            mine: dict[str, torch.Tensor] | None = layout.share(layout.tensors(), self._ctx.rank, self._ctx.world_size)
            buffers = {k: v for k, v in mine.items() if k in layout.buffer_keys}
        else:
            # Parameters and optimizer state are the same tensors from step to step: which of them
            # this rank saves is settled on the writer thread, off the loop (see snapshot.py).
            mine = None
            buffers = {live_state.MODEL_PREFIX + name: b for name, b in self._model.named_buffers()}
        trainer = self._trainer_state(step, rng_states, extra, settings) if self._ctx.is_main else None
        now = copy_now({"trainer": trainer, "buffers": buffers}, self._pool, self._ctx.device, self._copy_stream)
        record = _SaveRecord(
            step, reason, wall_started, 0.0, now["trainer"], now["buffers"],
            {k: v for k, v in mine.items() if k not in layout.buffer_keys} if mine is not None else None,
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
        elif not busy and not self._ctx.is_main:
            self._collect(block=True)  # rank 0 is done, so this rank's part has left every collective
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
        if not self._ctx.is_main:
            # Rank 0's save is over, so this rank's part has left every collective of it.
            try:
                self._collect(block=True, timeout=self._wait_slice)
            except TimeoutError:
                logger.warning("this rank's part of the checkpoint is still finishing after rank 0 committed it")

    def _timed_out(self, waited: float | None = None) -> str:
        record = self._in_flight
        what = f"the {record.reason} checkpoint of step {record.step}" if record else "a checkpoint"
        waited = self.timeout if waited is None else waited
        return (
            f"{what} did not commit within {waited:g} s (--ckpt-timeout): {self.store.root} is too slow "
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
        return str(self._broadcast_object(message))

    def _broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        self._broadcast_objects(box)
        return box[0]

    def _broadcast_objects(self, box: list[Any]) -> None:
        # broadcast_object_list pickles in memory between trusted peers; files hold plain types only.
        if self._ctx.distributed:
            dist.broadcast_object_list(box, src=0, group=control_group())

    def share_stop_reason(self) -> str:
        """Rank 0's `stop_reason` on every rank (a collective, after a vote said to stop)."""
        return self._share_message(self._stop_reason) or "checkpoint saves keep failing"

    def close(self, wait: float | None = None) -> None:
        """Commit what is in flight (waiting at most `wait`, default `timeout`) and detach from
        the optimizer; safe on error paths, where a failed save is only reported. Past `wait`
        the save is abandoned to its daemon thread and the exit does not wait for it."""
        wait = self.timeout if wait is None else wait
        if self._fatal is not None:
            wait = 0.0  # flush already waited --ckpt-timeout for it
        try:
            if self._in_flight is not None:
                try:
                    self._collect(block=True, timeout=wait)
                except TimeoutError:
                    self._writer.drain_timeout = 0  # nor at interpreter exit
                    if self._ctx.is_main:
                        logger.warning("%s", self._timed_out(wait))
        finally:
            try:
                self._writer.close(timeout=0 if self._writer.busy else None)
            except TimeoutError:
                pass  # reported above; the daemon thread finishes or dies with the process
            except Exception as exc:  # noqa: BLE001 - a non-main rank's part of a failed save: rank 0 reported it
                logger.debug("checkpoint writer: %s", exc)
            finally:
                self._stop_heartbeat()
                if self._memory is not None:
                    self._memory.close(timeout=wait)
                if self._hook is not None:
                    self._hook.remove()
                    self._hook = None

    def _prepare(self) -> None:
        if not self._prepared:
            self.store.prepare(self._identity)
            self._prepared = True
            self._heartbeat.start()
            atexit.register(self._stop_heartbeat)  # if close() is never reached

    def _stop_heartbeat(self) -> None:
        """Stop and join the heartbeat thread: a daemon thread still alive while the
        interpreter shuts down can abort the process ("terminate called without an active
        exception") instead of letting it exit 0."""
        self._closing.set()
        if self._heartbeat.is_alive():
            self._heartbeat.join(timeout=5.0)
        atexit.unregister(self._stop_heartbeat)

    def _beat(self) -> None:
        """Heartbeat thread (rank 0): keep the claim on the directory fresh between rare commits,
        so another host never takes this job for gone; stops once the claim is lost."""
        assert self._identity is not None
        interval = self._identity.stale_after / 4
        while not self._closing.wait(interval):
            try:
                self.store.heartbeat(self._identity)
            except SaveFailed:
                return  # another writer took the directory: the next commit says so
            except OSError as exc:
                logger.debug("heartbeat on %s failed: %s", self.store.root, exc)

    def _gather_rng(self) -> list[dict[str, Any]]:
        mine = get_rng_state(self._ctx.device)
        if not self._ctx.distributed:
            return [mine]
        gathered: list[Any] = [None] * self._ctx.world_size if self._ctx.is_main else []
        # gather_object pickles in memory between trusted peers; the file holds plain types only.
        dist.gather_object(mine, gathered if self._ctx.is_main else None, dst=0, group=control_group())
        return gathered

    def _trainer_state(
        self, step: int, rng_states: list[dict[str, Any]], extra: dict[str, Any], settings: dict[str, Any],
        *, check: bool = True,
    ) -> dict[str, Any]:
        def plain(name: str, tree: Any) -> Any:
            return plain_state(name, tree) if check else tree

        return {
            "step": step,
            "world_size": self._ctx.world_size,
            "sampler": self._sampler.state_dict(),
            "aliases": dict(self._layout.aliases),
            "module_extra": plain("module extra state", self._layout.extra_state()),
            # Checked like extra state: what a weights_only load could not read back fails now, not at restore.
            "scheduler": plain("scheduler", self._scheduler.state_dict()) if self._scheduler is not None else None,
            "scaler": plain("scaler", self._scaler.state_dict()) if self._scaler is not None else None,
            "extra": extra,
            "optimizer": settings,
            "rng": rng_states,
        }

    def _wait_sources_free(self) -> None:
        """Optimizer step pre-hook: the step may change parameters once the save (and the
        snapshot) have read them."""
        if self._snapshot_copy is not None:
            # The whole snapshot (copy, checksums, header, replica), not only the copy: a step
            # whose parameters change is finished, and a failure after it must find that step's
            # snapshot whole, so that at most one finished step is ever redone.
            started = time.perf_counter()
            self._snapshot_copy.wait_sources_free()
            self._snapshot_copy = None
            if self._memory is not None:
                self._memory.wait_previous()
                self._memory.step_wait_seconds.append(time.perf_counter() - started)
        record = self._in_flight
        if record is None or record.sources_released:
            return
        started = time.perf_counter()
        record.deferred.wait_sources_free()
        record.sources_released = True
        record.blocking_seconds += time.perf_counter() - started

    def _write(self, record: _SaveRecord) -> _Outcome:
        """Writer thread, every rank: copy this rank's share, write it (a collective over the
        checkpoint group); rank 0 then writes trainer.pt and the manifest and commits. A storage
        failure is an outcome (the loop goes on), not an exception; anything else is a bug and raises."""
        if self._ctx.device.type == "cuda":
            torch.cuda.set_device(self._ctx.device)  # this thread's allocations and copies belong to this rank's GPU
        name = checkpoint_name(record.step)
        tmp = self.store.begin(record.step, self._tag)
        copy_error: str | None = None
        try:
            tensors = record.deferred.run(lambda: self._sources(record), self._pool)
            tensors.update((k, v) for k, v in record.buffers.items() if k in self._mine_keys)
        except Exception as exc:  # noqa: BLE001 - out of (pinned) memory: a failed save, on every rank alike
            copy_error = f"rank {self._ctx.rank} could not copy its state: {describe_failure(exc)}"
        # Every rank says whether it has its part before any joins DCP: one that has not must not
        # leave the others waiting in DCP's collectives.
        if not self._all_ranks_ok(copy_error is None):
            if self._ctx.is_main:
                self.store.abort(tmp)
            what = copy_error or "another rank could not copy its state (its log says why)"
            return _Outcome(time.time(), f"cannot write {name} to {self.store.root}: {what}")
        try:
            writer = sharded.save_tensors(
                tensors, tmp, group=self._group,
                after_first_item=lambda: self._faults.at("during_write", record.step),
            )
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's CheckpointException (a BaseException), on every rank
            if self._ctx.is_main:
                self.store.abort(tmp)
            return _Outcome(time.time(), f"cannot write {name} to {self.store.root}: {describe_failure(sharded.first_error(exc))}")
        if not self._ctx.is_main:
            return _Outcome(time.time(), None)
        try:
            # From what every rank reported writing, not a directory listing (another host's
            # files can be missing from this host's cached view of the directory).
            files = {file_name: {"bytes": size} for file_name, size in sorted(writer.file_sizes.items())}
            tensors_json = (tmp / sharded.TENSORS_FILE).read_bytes()
            # The whole file's crc32c, as the store checks it (block_checksums()[0] covers only its first block).
            files[sharded.TENSORS_FILE] = {"bytes": len(tensors_json), "crc32c": crc32c.crc32c(tensors_json)}
            files[TRAINER_FILE] = self.store.write_state_file(tmp, TRAINER_FILE, record.trainer)
            sampler = record.trainer["sampler"]
            manifest = Manifest(
                step=record.step, epoch=int(sampler["epoch"]), consumed=int(sampler["consumed"]),
                world_size=self._ctx.world_size, files=files, created=time.time(),
                reason=record.reason, run_id=self._ctx.run_id, versions=versions(),
            )
            self.store.finish(
                tmp, manifest, owner=self._identity,
                before_commit=lambda: self._faults.at("before_commit", record.step),
            )
        except SaveFailed as exc:
            return _Outcome(time.time(), str(exc))
        except OSError as exc:  # writing trainer.pt, renaming, retiring
            self.store.abort(tmp)
            return _Outcome(time.time(), f"cannot commit {name} in {self.store.root}: {describe_failure(exc)}")
        return _Outcome(time.time(), None)

    def _sources(self, record: _SaveRecord) -> dict[str, torch.Tensor]:
        """Writer thread: this rank's share of the live tensors, buffers left out (copied already);
        `_mine_keys` says which of the buffer copies are this rank's to write."""
        if record.sources is not None:
            self._mine_keys = frozenset(record.sources) | frozenset(record.buffers)
            return record.sources
        layout = self._layout
        mine = layout.share(layout.tensors(), self._ctx.rank, self._ctx.world_size)
        self._mine_keys = frozenset(mine)
        return {k: v for k, v in mine.items() if k not in layout.buffer_keys}

    def _all_ranks_ok(self, ok: bool, *, on_loop: bool = False) -> bool:
        """Whether `ok` holds on every rank: a collective on the save group (writer thread), or on
        the control group with `on_loop` (the loop's thread, at restore)."""
        if not self._ctx.distributed:
            return ok
        flag = torch.tensor([int(ok)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=control_group() if on_loop else self._group)
        return bool(flag.item())

    def _collect(self, *, block: bool, timeout: float | None = None) -> None:
        """Report the save in flight if it has finished (waiting for it if `block`, at most
        `timeout` seconds: `TimeoutError` then, and it stays in flight). Only rank 0 reports."""
        record = self._in_flight
        if record is None or (not block and self._writer.busy):
            return
        outcome: _Outcome = self._writer.wait(timeout)
        self._in_flight = None
        if not self._ctx.is_main:
            return
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


def _numel(shape: torch.Size) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _is_timeout(exc: BaseException) -> bool:
    """A collective that timed out waiting for a rank still reading (gloo names it in its message)."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text
