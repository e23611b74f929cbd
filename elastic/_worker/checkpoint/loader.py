"""Reading a chosen step into host buffers on every rank, then, everything verified, into the live state.

Invariants:
- Every rank reads only the chunks it needs, each sharded tensor resharded to
  this world size, each replicated one read by one rank (`state.owners`) and
  broadcast, checking every chunk's crc32c as it reads: each byte is read and
  verified once per job.
- Only when every rank read everything is the live state changed; a chunk
  that fails its check on any rank is a `CorruptCheckpoint` on every rank (the
  read is DCP's collective), and nothing live has changed.
- Reading runs on a thread: a read stuck in the kernel (a hung mount) cannot
  be interrupted, but the rank stops waiting at the deadline
  (`RestoreTimedOut`, exit 75). Storage errors are `CheckpointStorageError`.
- Every rank takes the same outcome (`Loader._agree`): after reading, the
  ranks gather what each met (read, corrupt, storage error, timed out, ...) on
  the control group, and every rank raises the worst of them in the words of
  the lowest rank that met it. A rank whose clock passed the deadline and one
  whose read just finished, or one that met EIO and one that read fine, never
  part ways (one stopping while another goes on to the next offer).
  The reader is an `elastic._shared.common.threads` one: the exit joins it, or ends the
  process with that 75 without finalizing (see there).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic._shared.common import threads
from elastic._shared.common.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointStorageError,
    CorruptCheckpoint,
    RestoreTimedOut,
)
from elastic._shared.storage import sharded, tensors_json
from elastic._shared.storage.checkpoint_storage import CheckpointStorage
from elastic._shared.storage.durable import describe_failure
from elastic._shared.storage.manifest import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    TRAINER_FILE,
    Candidate,
)
from elastic._worker.checkpoint import compat, flat_broadcast
from elastic._worker.checkpoint import state as live_state
from elastic._worker.checkpoint.part_files import PartFetchError
from elastic._worker.checkpoint.snapshot import dtensor_like
from elastic._worker.checkpoint.sources import Offer, Opened
from elastic._worker.checkpoint.training_state import TrainingState
from elastic._worker.control import agreement
from elastic._worker.runtime.context import WorkerContext


class Loader:
    """Loads offers into one rank's live state (see the module docstring)."""

    def __init__(
        self, ctx: WorkerContext, state: TrainingState, store: CheckpointStorage[Any], *, group: dist.ProcessGroup | None,
        restore_timeout: float, fault: Any = lambda point, step: None,
    ) -> None:
        self._ctx = ctx
        self.state = state
        self.store = store
        self._group = group
        self._restore_timeout = restore_timeout
        self._fault = fault

    def load(self, offer: Offer, opened: Opened, deadline: float) -> int:
        """Read and apply `offer` (a collective); bytes of tensor data this rank read. A failure
        is the same one on every rank (see the module docstring)."""
        error: Exception | None = None
        apply: Callable[[], int] | None = None
        self._fault("before_read", offer.step)
        try:
            if offer.tensors_json is None:
                apply = self._read_format1(offer, opened)
            else:
                apply = self._read_sharded(offer, opened, deadline)
        except Exception as exc:  # noqa: BLE001 - agreed on below, then raised on every rank
            error = exc
        self._agree(offer, error)
        assert apply is not None
        return apply()

    def _agree(self, offer: Offer, error: Exception | None) -> None:
        """Raise, on every rank, the worst outcome any rank met reading `offer` (none: return)."""
        mine = _Outcome.of(error, f"cannot read {offer.name} in {self.store.root}")
        worst = max(agreement.all_gather(self._ctx, mine, _Outcome), key=lambda o: o.code)
        if worst.code == _READ:
            return
        if worst.code == _FAILED and error is not None and mine.code == _FAILED:
            raise error  # this rank's own failure, as it was (the launcher restarts the job)
        raise worst.error()

    def _read_sharded(self, offer: Offer, opened: Opened, deadline: float) -> Callable[[], int]:
        ctx, model, optimizer = self._ctx, self.state.model, self.state.optimizer
        metadata = tensors_json.metadata_from_json(offer.tensors_json or "")
        saved = tensors_json.tensor_shapes(metadata)
        live = live_state.live_tensors(model, optimizer)
        params = dict(model.named_parameters())
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
            {key: _numel(shape) * dtype.itemsize for key, (shape, dtype) in plain.items()}, ctx.world_size
        )
        for key, (shape, dtype) in plain.items():
            if owner[key] == ctx.rank:
                targets[key] = torch.empty(shape, dtype=dtype)
        read = self._read(offer, opened, targets, metadata, deadline)

        def apply() -> int:
            # Everything read and verified on every rank: only now does live state change.
            trainer = offer.trainer
            self.state.apply_extra(offer.step, trainer)
            self._apply_tensors(live, targets, plain, owner, trainer["optimizer"])
            live_state.set_module_extra_state(model, trainer.get("module_extra", {}))
            self.state.apply_trainer(ctx, offer.step, trainer)
            return read

        return apply

    def _read(self, offer: Offer, opened: Opened, targets: dict[str, torch.Tensor], metadata: Any, deadline: float) -> int:
        timed_out = RestoreTimedOut(
            f"restoring {offer.name} from {self.store.root} did not finish within "
            f"{self._restore_timeout:g} s (--ckpt-restore-timeout): the storage is too slow or hung"
        )
        outcome: dict[str, Any] = {}
        step = offer.step

        def read() -> None:
            try:
                outcome["bytes"] = sharded.load_tensors(
                    targets, opened.directory, metadata, group=self._group, deadline=deadline,
                    after_first_chunk=lambda: self._fault("during_read", step), source=opened.chunks,
                )
            except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
                outcome["error"] = exc

        reader = threads.start(read, name="checkpoint-restore")
        reader.join(max(0.0, deadline - time.monotonic()) + 5.0)  # peers' own deadlines fire first
        if reader.is_alive():
            threads.note_exit_status(timed_out.exit_code)  # if the read outlives the exit's wait
            raise timed_out
        if "error" not in outcome:
            return int(outcome["bytes"])
        error = sharded.first_error(outcome["error"])
        if isinstance(error, CorruptCheckpoint):
            raise error
        if isinstance(error, PartFetchError):  # every rank alike, whatever its clock says
            raise CheckpointStorageError(f"cannot read {offer.name} from the other nodes: {error}")
        if isinstance(error, TimeoutError) or (_is_timeout(error) and time.monotonic() >= deadline):
            raise timed_out
        if isinstance(error, OSError):
            raise CheckpointStorageError(f"cannot read {offer.name} in {self.store.root}: {describe_failure(error)}")
        raise outcome["error"]  # a peer died mid-restore: a failure like any other, which the launcher restarts

    def _apply_tensors(
        self,
        live: dict[str, torch.Tensor],
        targets: dict[str, torch.Tensor],
        plain: dict[str, tuple[torch.Size, torch.dtype]],
        owner: dict[str, int],
        optimizer_settings: dict[str, Any],
    ) -> None:
        model, optimizer = self.state.model, self.state.optimizer
        optimizer_tensors: dict[str, torch.Tensor] = {}
        params = dict(model.named_parameters())
        by_owner: dict[int, list[torch.Tensor]] = {}
        """Each replicated tensor's destination by the rank that read it, in the order of their keys."""
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
                by_owner.setdefault(owner[key], []).append(dest)
            if self._ctx.distributed:  # each owner's tensors in a few broadcasts, not one each
                for source_rank, dests in sorted(by_owner.items()):
                    flat_broadcast.broadcast(dests, source_rank, rank=self._ctx.rank, group=self._group)
        optimizer.load_state_dict(
            live_state.optimizer_state_dict(model, optimizer, optimizer_tensors, optimizer_settings)
        )

    def _read_format1(self, offer: Offer, opened: Opened) -> Callable[[], int]:
        """A checkpoint of torchrevive 0.1 (rank 0's whole files): every rank reads them itself."""
        model, optimizer = self.state.model, self.state.optimizer
        candidate = Candidate(offer.checkpoint, offer.step, opened.directory)
        if any(isinstance(t, sharded.DTensor) for t in model.state_dict().values()):
            raise CheckpointError(
                f"checkpoint {candidate.path} is in format 1 (one file per state, written by rank 0); a sharded "
                "(FSDP2) model cannot load it: resume it once without FSDP, which writes the sharded format"
            )
        manifest = offer.parsed_manifest
        files = {
            name: self.store.load_state_file(candidate, manifest, name, map_location=self._ctx.device)
            for name in (MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE)
        }
        compat.check_model(candidate.name, model.state_dict(), files[MODEL_FILE])
        compat.check_optimizer(candidate.name, optimizer, files[OPTIMIZER_FILE])

        def apply() -> int:
            self.state.apply_extra(offer.step, files[TRAINER_FILE])
            model.load_state_dict(files[MODEL_FILE])
            optimizer.load_state_dict(files[OPTIMIZER_FILE])
            self.state.apply_trainer(self._ctx, offer.step, files[TRAINER_FILE])
            return 0

        return apply


_READ, _CORRUPT, _STORAGE, _REFUSED, _FAILED, _TIMED_OUT = range(6)
"""What a rank met reading an offer, mildest first: the ranks take the worst any of them met."""


@dataclass(frozen=True)
class _Outcome(agreement.Message):
    """One rank's outcome of reading an offer: a code (above), the error's class and its one line."""

    code: int
    kind: str
    message: str

    @classmethod
    def of(cls, error: Exception | None, cannot_read: str) -> _Outcome:
        if error is None:
            return cls(_READ, "", "")
        line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        if isinstance(error, RestoreTimedOut):
            return cls(_TIMED_OUT, "RestoreTimedOut", line)
        if isinstance(error, CorruptCheckpoint):
            return cls(_CORRUPT, "CorruptCheckpoint", line)
        if isinstance(error, CheckpointStorageError):
            return cls(_STORAGE, "CheckpointStorageError", line)
        if isinstance(error, CheckpointError):
            return cls(_REFUSED, type(error).__name__, line)
        if isinstance(error, OSError):  # a format-1 file, which every rank reads whole
            return cls(_STORAGE, "CheckpointStorageError", f"{cannot_read}: {describe_failure(error)}")
        return cls(_FAILED, type(error).__name__, line)

    def error(self) -> Exception:
        """The error every rank raises for this outcome."""
        if self.code == _CORRUPT:
            return CorruptCheckpoint(self.message)
        if self.code == _FAILED:
            return CheckpointError(f"another rank failed reading the checkpoint: {self.kind}: {self.message}")
        known = {cls.__name__: cls for cls in (CheckpointStorageError, RestoreTimedOut, CheckpointMismatchError)}
        return known.get(self.kind, CheckpointError)(self.message)


def _numel(shape: torch.Size) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _is_timeout(exc: BaseException) -> bool:
    """A collective that timed out waiting for a rank still reading (gloo names it in its message)."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text
