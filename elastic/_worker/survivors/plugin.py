"""The survivors plug-in of a `Run`: its group changes in its own processes (a peer died, or a worker waits to join).

A `Run` under torchrevive-run with `--survivors keep|train-on` (TORCHREVIVE_SURVIVORS)
holds one `Survivors` (`Survivors.from_environ`) and meets it only through
the hooks below, in the order it calls them; what the plug-in needs of the
run it gets through `RunHost`, a private adapter of the run (no public `Run`
member exists for it). elastic._worker.survivors.healing forms the groups,
elastic._worker.survivors.views says who is in them with train-on.

Hooks: `first_group` (the first process group's arguments), `prepare_ddp` and
`attach` (the model `run.ddp` builds), `fault_rank`, `arm` (in `Run.start`:
count this worker a healer, or why not), `join` / `catch_up_replacement` (a
replacement's state), `joiners_waiting` and `on_new_group` (what a group's
parts need), then per step `can_heal`, `before_step`, `void`, `failed`,
`grow_due` and `grow`, and `job_ended` in `Run.finish`. The changes themselves
(`failed`, `grow`, `join`, `catch_up_replacement`) are elastic._worker.survivors.changes',
phase by phase through the lifecycle (elastic._worker.survivors.lifecycle).

Invariants:
- Every member of a group changes group at the same step (a failure voids the
  same step everywhere; a grow happens at a vote step, which every rank reads
  alike), and the state after a change is one member's: nothing is read from disk.
- With train-on the data position is the sampler's, whatever the world size: the
  steps after a change take the rest of the epoch at the new size, every sample
  once (exactly-once, not bit-identical to a run that never changed size).
- A change that cannot complete is `RegroupError` (exit status 76: a new round).
- A worker waiting to join when the job ends leaves with status 0 (`JobEnded`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch

from elastic._shared.protocol.fault_hook import NO_FAULTS
from elastic._worker.runtime.context import WorkerContext
from elastic._worker.survivors.changes import GroupChanges, JobEnded, RunHost
from elastic._worker.survivors.healing import Healing, StepStart
from elastic._worker.survivors.joiners import joiners_waiting
from elastic._worker.survivors.lifecycle import Lifecycle
from elastic._worker.survivors.regroup import RegroupError

logger = logging.getLogger(__name__)

__all__ = ["JobEnded", "RunHost", "Survivors"]


class Survivors:
    """One worker's group changes in place (see the module docstring)."""

    def __init__(self, healing: Healing) -> None:
        self.healing = healing
        self._host: RunHost | None = None
        self._training: tuple[torch.optim.Optimizer, Any, Any] | None = None
        self._changes: GroupChanges | None = None
        self.lifecycle = Lifecycle()
        """This worker's phase among the survivors (elastic._worker.survivors.lifecycle)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], *, timeout: timedelta, heal_wait: timedelta) -> Survivors | None:
        """The plug-in when this worker's agent heals in place (it gave the worker a heal point); else None."""
        healing = Healing.from_environ(environ, timeout=timeout, heal_wait=heal_wait)
        return cls(healing) if healing is not None else None

    # -- hooks, in the order a run calls them ------------------------------------------------------

    @property
    def train_on(self) -> bool:
        return self.healing.train_on

    @property
    def joiner(self) -> bool:
        """A replacement of train-on: rank 0 of a group of its own until a grow admits it (writes no events)."""
        return self.healing.joiner

    def first_group(self) -> dict[str, Any]:
        """`init_worker`'s arguments for this worker's first process group."""
        return self.healing.first_group()

    def prepare_ddp(self, options: dict[str, Any]) -> None:
        """A replacement's DDP skips DDP's first broadcast: its state comes from a survivor in `Run.start`."""
        if self.healing.replacement:
            options.setdefault("init_sync", False)

    def attach(self, model: torch.nn.Module) -> None:
        """Reduce the gradients of `model` (run.ddp's) through the step guard."""
        self.healing.attach(model)

    def fault_rank(self) -> int:
        """The rank this worker started as (a chaos fault names it, whatever the group made of it since)."""
        return self.healing.point.rank

    def arm(self, host: RunHost, ctx: WorkerContext, training: tuple[torch.optim.Optimizer, Any, Any],
            faults: Any) -> None:
        """In `Run.start`, before the first step: count this worker a healer when it can heal (else a
        failure restarts every worker, as without the setting; a joiner that cannot has no group to join).
        `training`: the optimizer, scheduler and grad scaler a void step's undo puts back."""
        if not self.healing.arm(ctx, training[0]):
            if self.healing.joiner:
                raise RegroupError("a replacement that cannot heal in place has no group to join")
            return
        self._host, self._training = host, training
        self._changes = GroupChanges(self.healing, host, training, self.lifecycle)
        self._changes.armed()
        if faults is not NO_FAULTS:  # the chaos suite's kills inside a gradient all-reduce and a heal
            self.healing.guard.before_reduce = lambda: faults.at("during_all_reduce", host.step + 1)
            self.healing.fault = lambda point: faults.at(point, host.step + 1)

    @property
    def armed(self) -> bool:
        return self._host is not None

    @property
    def replaces_a_worker(self) -> bool:
        """Armed, and started by a heal (keep): its state comes from a survivor's memory."""
        return self.armed and self.healing.replacement

    def joiners_waiting(self, ctx: WorkerContext) -> Callable[[], int] | None:
        """What rank 0's step vote asks each vote step (train-on): the newest ticket of a worker waiting to join."""
        if self.healing.train_on and ctx.is_main:
            records = self.healing.point.signed_records
            return lambda: joiners_waiting(records)
        return None

    def on_new_group(self, ctx: WorkerContext, events: Any, path: Any) -> None:
        """With train-on the group's rank 0 writes the event log (rank 0 may be another worker now)."""
        if self.healing.train_on:
            events.write_to(path if ctx.is_main else None)

    @property
    def can_heal(self) -> bool:
        """Armed and counted: a failed collective is healed in place, not a restart."""
        return self.armed and self.healing.ready

    def before_step(self, device: torch.device) -> StepStart:
        """What a void step's undo puts back (the step's settings, scheduler, scaler and RNG states)."""
        assert self._training is not None
        optimizer, scheduler, scaler = self._training
        return self.healing.before_step(device, optimizer, scheduler, scaler)

    @property
    def void(self) -> bool:
        """The step just trained failed on this rank (its gradient all-reduce did)."""
        return self.healing.void

    @property
    def void_reason(self) -> str | None:
        return self.healing.guard.error

    def void_step(self, why: str) -> None:
        """A collective between steps (a pause's) failed before the update of the step whose batch the script
        holds: that step is void on this rank (its gradient all-reduce does not wait on the broken group), and
        `failed` heals the group after it, as for a failed gradient all-reduce."""
        self.healing.guard.failed(RuntimeError(why))

    def grow_due(self, joiners: int) -> bool:
        """At a vote step: workers waiting to join (tickets up to `joiners`) were not considered yet."""
        return self.armed and self.healing.train_on and joiners > self.healing.view.considered

    def job_ended(self, ctx: WorkerContext) -> None:
        """In `Run.finish`: workers still waiting to join leave (train-on, rank 0)."""
        if self.healing.train_on and ctx.is_main:
            self.healing.job_ended()

    # -- the changes, through `GroupChanges` (elastic._worker.survivors.changes) -----------------------

    @property
    def changes(self) -> GroupChanges:
        assert self._changes is not None, "Survivors.arm comes first"
        return self._changes

    def failed(self, started: StepStart | None, why: str | None) -> bool:
        """A collective failed (see elastic._worker.survivors.changes); True when the rank or world size changed."""
        return self.changes.failed(started, why)

    def grow(self, upto: int) -> bool:
        """Admit the joiners of tickets up to `upto`; True when the group changed."""
        return self.changes.grow(upto)

    def join(self) -> None:
        """A train-on replacement: wait to be admitted, then take the state."""
        self.changes.join()

    def catch_up_replacement(self) -> int:
        """A keep replacement (in `Run.start`): the state of a survivor, from its memory."""
        return self.changes.catch_up_replacement()
