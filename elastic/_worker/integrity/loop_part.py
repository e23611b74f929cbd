"""The integrity part of a `Run`: replica checks, the numeric guard, their rollback point and the
faults that tamper with numbers, met by the step loop through three calls.

    part = Integrity(ctx, config, events)                      # before the state is registered
    state = TrainingState(..., extra=part.registered(extra))
    part.attach(state, optimizer, faults, stack, loss=...)   # restored: the point, the checks, the hooks
    part.loop_started(step)             # the first rollback point
    part.step_starting(step)            # before step `step + 1` trains (ELASTIC_FAULT do=nan)
    back_to = part.step_ended(step, ctx)  # after the step's update: flips, the guard's rollback, the check

Invariants:
- Every rank makes the same calls at the same steps, and `step_ended` returns
  the same answer on every rank: None (go on), or the step every rank's state
  was rolled back to (the loop goes on from it, its feed opened again there).
- The rollback point serves both: the replica check moves it after each
  passing check; with checks off and `--numeric-guard rollback`, it is the
  loop's first step. Rolling back never forgets a skipped step: the guard's
  skipped steps survive the rollback (they are not the point's to restore).
- Off (`--replica-check-every 0`, `--numeric-guard off`, no tampering fault),
  nothing is copied, hooked or exchanged.
- A step skipped for its batch (the numeric guard's, or a replica check's
  `batch` verdict) is one record, the guard's `skipped`: checkpointed whenever
  either is on, and its pre-hook on the optimizer step is added once a skip
  exists (with the guard off, a steady step pays nothing for it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from typing import Any

import torch

from elastic._shared.protocol import fault_hook
from elastic._shared.protocol.fault_hook import FaultHook
from elastic._worker.checkpoint.training_state import TrainingState
from elastic._worker.config import RunConfig
from elastic._worker.control import agreement
from elastic._worker.integrity import tamper
from elastic._worker.integrity.numeric_guard import (
    ROLLBACK,
    STATE_NAME,
    TRANSIENT,
    NumericGuard,
)
from elastic._worker.integrity.replica_check import ReplicaCheck
from elastic._worker.integrity.rollback import RollbackPoint
from elastic._worker.observe.events import EventLog
from elastic._worker.runtime.context import WorkerContext

logger = logging.getLogger(__name__)


class Integrity:
    """See the module docstring. Made before the state is registered (`registered`: the guard's
    skipped steps are checkpointed), then `attach`ed once the state is restored."""

    def __init__(self, ctx: WorkerContext, config: RunConfig, events: EventLog,
                 group: Any = agreement.DEFAULT_GROUP) -> None:
        self.ctx = ctx
        self._regrouped = False
        self.config = config
        self.events = events
        self.group = group
        self.guard = NumericGuard(config.numeric_guard, spike=config.loss_spike,
                                  agree=lambda bad: agreement.any_set(self.ctx, bad, group=group)[0])
        self.faults: FaultHook = fault_hook.NO_FAULTS
        self.nan: tamper.NanLoss | None = None
        self.handles: list[Any] = []
        self._checking = config.replica_check_every != 0 and ctx.distributed
        """Replica checks may run (and skip a batch they find at fault)."""
        self._hook: Callable[[], None] | None = None
        self._trains: list[int] = []
        """With a fault plugin loaded: the samples this rank trains in the current step."""
        self._training = 0
        """The step being trained (the one `step_starting` was called for): the guard's step."""

    def registered(self, extra: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        """The run's extra objects, and the guard's state among them when it is on."""
        return {**(extra or {}), STATE_NAME: self.guard} if self.guard.on or self._checking else extra

    def attach(self, state: TrainingState, optimizer: torch.optim.Optimizer, faults: FaultHook, stack: ExitStack,
               loss: Callable[[], torch.Tensor | None] | None = None) -> Integrity:
        """Hook onto the restored state: the rollback point, the checks, the guard's pre-hook on the
        optimizer step (`loss()`: the loss the script logged for the step being trained, None when
        not yet), the NaN hook when a fault plugin is loaded. Detached when `stack` closes."""
        self.state, self.faults = state, faults
        sharded = any(hasattr(p, "to_local") for p in state.model.parameters())  # FSDP2: no replica vouches for a shard
        self.rollback = RollbackPoint(state, self.ctx.device, verify=sharded, rank=self.ctx.rank)
        self.check = ReplicaCheck(self.ctx, self.rollback, state.model, self.config.replica_check_every,
                                  events=self.events, group=self.group, sampler=state.sampler, skip=self._skip,
                                  saves_every=self.config.ckpt_every_steps if self.config.ckpt_dir is not None else 0)
        if faults is not fault_hook.NO_FAULTS:
            self.nan = tamper.NanLoss(state.model)
            self.check.before_exchange = lambda: faults.at("during_replica_check", self._training)
        params = [p for g in optimizer.param_groups for p in g["params"]]

        def hook() -> None:
            self.handles.append(optimizer.register_step_pre_hook(
                lambda *_: self._before_update(params, loss() if loss is not None else None)))

        self._hook = hook
        if self.guard.on or self.guard.skipped:  # restored: a run resumed after a skip skips it again
            self._hooked()
        stack.callback(self.close)
        return self

    def _hooked(self) -> None:
        if not self.handles and self._hook is not None:
            self._hook()

    def _skip(self, step: int) -> bool:
        """A replica check found step `step`'s batch at fault: its update is skipped from now on
        (False: it was skipped already, so the batch is not what goes wrong)."""
        if step in self.guard.skipped:
            return False
        self.guard.skipped.add(step)
        self._hooked()
        return True

    def loop_started(self, step: int, *, group_from: int | None = None, rotatable: bool | None = None) -> None:
        """The loop starts at `step`; `rotatable`: whether its loader follows the sampler's blocks."""
        self._training = step + 1
        if rotatable is not None:
            self.check.rotatable = rotatable
        if self.check.enabled:
            self.check.start(step, group_from=group_from)
        elif self.guard.policy == ROLLBACK and self.rollback.step is None:
            self.rollback.take(step)

    def regrouped(self) -> None:
        """A group formed in place took over from this member's last one (a heal keeps the ranks, and
        so the context): the step that ends next on it is its first (`on_new_group`)."""
        self._regrouped = True

    def on_new_group(self, ctx: WorkerContext, step: int) -> None:
        """The group changed in place (survivors) and this member completed its first step on it,
        `step`: checks run on the new one, from a point of `step`, at the steps a member that
        joined it before that step checks at (the group went on from `step - 1`)."""
        self.ctx = ctx
        self.check.on_new_group(ctx)
        self.rollback.point = None
        self.loop_started(step, group_from=step - 1)

    def step_starting(self, step: int) -> None:
        self._training = step + 1
        if self.nan is None:  # no fault plugin loaded: nothing more on a steady step
            return
        self._trains = self._my_samples()
        if fault_hook.tampering(self.faults, "after_step", step + 1, "nan", self._trains):
            self.nan.armed = True

    def _my_samples(self) -> list[int]:
        """The sample indices this rank trains in the step about to start (for faults that follow a
        sample; sliced from the global batch: `local_batch` means "trained now" to the sample audit)."""
        sampler, ctx = self.state.sampler, self.ctx
        first, count = sampler.share(ctx.rank, ctx.world_size)
        return sampler.global_batch(ctx.world_size)[first:first + count].tolist()

    def step_ended(self, step: int, ctx: WorkerContext, settle: Callable[[], None] = lambda: None,
                   save_due: Callable[[int], bool] = lambda step: False) -> int | None:
        """Step `step` ended on the group of `ctx`: None, or the step every rank rolled back to.
        `settle()`: every rank's saves in flight committed, before a faulty rank leaves (a collective);
        `save_due(step)`: a checkpoint is due at the step (a check runs first)."""
        if ctx is not self.ctx or self._regrouped:  # a group formed in place (survivors): its state is agreed
            self._regrouped = False
            self.on_new_group(ctx, step)
            if not (self.check.enabled and save_due(step)):
                return None
            # A checkpoint is due at this very step: a member that joined the group before it (a
            # replacement, which took the state at the step before) checks first, so every member
            # must, or the replacement's exchange meets this member's save (a stall that only
            # another failure ended: issue 52).
            return self.check.after_step(step, settle, save_due=True)
        # a skipped step applied no update to corrupt
        if self.nan is not None and step not in self.guard.skipped and fault_hook.tampering(
                self.faults, "after_step", step, "flip", self._trains):
            name = tamper.flip_one_bit(self.state.model)
            logger.warning("ELASTIC_FAULT: flipped a bit of %s on rank %d after step %d", name, self.ctx.rank, step)
        kept = set(self.guard.skipped)  # the point's copy of them (an extra object) may be older: keep every skip
        if self.guard.rollback_due is not None:
            self.guard.rollback_due = None
            back_to: int | None = self.rollback.restore()
            if self.check.enabled:
                self.check.start(back_to)  # type: ignore[arg-type]
        else:
            back_to = self.check.after_step(step, settle, save_due=self.check.enabled and save_due(step))
        if back_to is not None:
            self.guard.skipped |= kept
        return back_to

    def _before_update(self, params: list[torch.Tensor], loss: torch.Tensor | None) -> None:
        step, known = self._training, len(self.guard.caught)
        action = self.guard.before_update(step, params, loss)
        outcome = self.guard.take_outcome()
        if outcome == TRANSIENT and self.ctx.is_main:
            logger.warning("step %d replayed after its rollback reads good: the numeric fault was transient; "
                           "the step is applied", step)
        if action is None or len(self.guard.caught) == known:
            return  # a good step, or one skipped before (replay, resume, a batch): its event was written then
        caught = self.guard.caught[-1]
        kind = {"kind": caught["kind"]} if "kind" in caught else {}  # a replay caught again: the batch
        self.events.emit("numeric", step=step, world_size=self.ctx.world_size, value=caught["value"],
                         why=caught["why"], action=action, **kind,
                         samples=self._samples(), rolled_back_to=self.rollback.step if action == ROLLBACK else None)
        if self.ctx.is_main:
            logger.warning("step %d: %s (%g) caught before the update: %s", step, caught["why"], caught["value"],
                           f"rolling back to step {self.rollback.step}, then judged again" if action == ROLLBACK
                           else "caught again on its replay: the batch is at fault, skipped" if kind else "skipped")

    def _samples(self) -> dict[str, int]:
        """Where the skipped batch sits in the epoch stream: the whole step's samples from (epoch, consumed)."""
        sampler = self.state.sampler
        return {"epoch": sampler.state.epoch, "consumed": sampler.state.consumed,
                "count": sampler.batch_size * self.ctx.world_size}

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self.nan is not None:
            self.nan.remove()
