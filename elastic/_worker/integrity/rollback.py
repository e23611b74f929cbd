"""The rollback point: every rank's whole training state as of the newest step a replica check passed.

A mismatch found at a check step means some step since the last passing check
went wrong on some rank; the state of that check is the newest one known good
on every rank. So each rank keeps a copy of its state in host memory, taken at
the step of a passing check (and at the loop's first step: a restored or
freshly seeded state that every rank holds alike), and replaced only when the
next check passes: a good one always exists. Rolling back puts it back on the
live objects; the loop then trains the steps since again, on the same samples
with the same random numbers, so a replay that passes its check ends
bit-identical to a run that never saw the fault.

What it holds is what a checkpoint holds of a rank (elastic._worker.checkpoint.training_state):
the model's and optimizer's tensors (by stable key, copied into buffers reused
from one point to the next: a steady-state point allocates nothing), the
optimizer's settings (learning rates a scheduler moved), the scheduler, the
grad scaler, the sampler's position, the user's extra objects, modules' extra
state, the step, and this rank's RNG states.

Invariants:
- `take` returns once every byte is copied (on CUDA: the device orders later
  kernels after the copies, and the host waits for them): the live state may
  change as soon as it returns.
- `restore` changes live objects only from the copy, never the copy itself: a
  second rollback to the same point restores the same state.
- A DTensor (an FSDP2 shard) is copied as its local shard and put back into the same shard.
- With `verify` (on under FSDP2, where no replica can vouch for a shard), `take`
  digests this rank's own parameters and buffers (their local shards) as it
  copies them, and `restore` digests them again once put back: a bit that
  changed in between (in the copy while it was kept, or on its way back) is
  `PointChanged`, naming the rank and the step, never a silent restore.
"""

from __future__ import annotations

import copy
import hashlib
import time
from dataclasses import dataclass
from typing import Any

import torch

from elastic._shared.common.errors import ElasticError
from elastic._shared.protocol.exit_status import FAULTY_NODE_EXIT
from elastic._worker.checkpoint import state as live_state
from elastic._worker.checkpoint.snapshot import BufferPool, copy_now
from elastic._worker.checkpoint.training_state import TrainingState
from elastic._worker.runtime.rng import get_rng_state, set_rng_state


@dataclass(frozen=True)
class Point:
    """A taken copy (see the module docstring)."""

    step: int
    tensors: dict[str, torch.Tensor]
    trainer: dict[str, Any]
    rng: dict[str, Any]
    seconds: float
    """What taking it cost the loop."""
    digest: str | None = None
    """`verify`: this rank's own parameters and buffers as copied (`local_digest`)."""


class PointChanged(ElasticError):
    """A rank's rollback point no longer holds what was copied: its node's memory is suspect."""

    exit_code = FAULTY_NODE_EXIT


def local_digest(model: torch.nn.Module) -> str:
    """sha256 over this rank's own parameters and buffers, bit for bit: a DTensor's local shard."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if not isinstance(tensor, torch.Tensor):
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        digest.update(name.encode())
        digest.update(local.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class RollbackPoint:
    """One rank's rollback point (see the module docstring)."""

    def __init__(self, state: TrainingState, device: torch.device, *, verify: bool = False, rank: int = 0) -> None:
        self._state = state
        self._device = device
        self.verify = verify
        self._rank = rank
        self._pool = BufferPool(pin_memory=device.type == "cuda")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.point: Point | None = None

    @property
    def step(self) -> int | None:
        """The step the point holds (None: none taken yet)."""
        return self.point.step if self.point is not None else None

    @property
    def nbytes(self) -> int:
        return self._pool.nbytes

    def take(self, step: int) -> Point:
        """Copy the state of `step` (the step just completed) off the live objects."""
        started = time.perf_counter()
        state = self._state
        digest = local_digest(state.model) if self.verify else None
        tensors = copy_now(state.layout.tensors(), self._pool, self._device, self._stream)
        trainer = copy.deepcopy({
            "optimizer": state.optimizer_settings(check=False),
            "scheduler": state.scheduler.state_dict() if state.scheduler is not None else None,
            "scaler": state.scaler.state_dict() if state.scaler is not None else None,
            "sampler": state.sampler.state_dict(),
            "extra": state.extra_state(check=False),
            "module_extra": state.layout.extra_state(),
        })
        self.point = Point(step, tensors, trainer, get_rng_state(self._device), time.perf_counter() - started, digest)
        return self.point

    def restore(self) -> int:
        """Put the point back on the live objects; returns its step."""
        point = self.point
        if point is None:
            raise RuntimeError("no rollback point was taken")
        state, trainer = self._state, copy.deepcopy(point.trainer)
        state.apply_extra(point.step, trainer)  # the user's code first: it may refuse, nothing else changed yet
        live = state.layout.tensors()
        with torch.no_grad():
            for key, saved in point.tensors.items():
                if key.startswith(live_state.MODEL_PREFIX):
                    target = live[key]
                    target = target.to_local() if hasattr(target, "to_local") else target
                    target.copy_(saved.to_local() if hasattr(saved, "to_local") else saved)
        if point.digest is not None and local_digest(state.model) != point.digest:
            raise PointChanged(
                f"rank {self._rank}: its rollback point of step {point.step} changed in memory since it was taken "
                "(a flipped bit on this node): it cannot undo a fault, and its node leaves the job"
            )
        # Clones: loading keeps a tensor already on the parameter's device and dtype as it is, and the
        # optimizer must never hold (and step) the point's own buffers.
        optimizer_tensors = {k: v.clone() for k, v in point.tensors.items() if k.startswith(live_state.OPTIM_PREFIX)}
        state.optimizer.load_state_dict(
            live_state.optimizer_state_dict(state.model, state.optimizer, optimizer_tensors, trainer["optimizer"])
        )
        live_state.set_module_extra_state(state.model, trainer["module_extra"])
        if state.scheduler is not None and trainer["scheduler"] is not None:
            state.scheduler.load_state_dict(trainer["scheduler"])
        if state.scaler is not None and trainer["scaler"] is not None:
            state.scaler.load_state_dict(trainer["scaler"])
        state.sampler.load_state_dict(trainer["sampler"])
        set_rng_state(point.rng, self._device)
        return point.step
