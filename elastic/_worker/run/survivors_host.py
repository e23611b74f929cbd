"""What the survivors plug-in reaches of a `Run`: its `RunHost` (elastic._worker.survivors.plugin).

An adapter, so that nothing on `Run`'s public surface exists only for the
survivors: the plug-in sets the step a new group goes on from, where `due`
counts from, rebuilds the group's parts and drops them before a group is left.
"""

from __future__ import annotations

from typing import Protocol

from elastic._worker.checkpoint import CheckpointManager
from elastic._worker.config import RunConfig
from elastic._worker.control.preemption import PreemptionHandler
from elastic._worker.control.watchdog import NoWatchdog, Watchdog
from elastic._worker.observe.events import EventLog
from elastic._worker.run.group import GroupParts
from elastic._worker.run.loop import StepLoop
from elastic._worker.runtime.context import WorkerContext


class HostedRun(Protocol):
    """What the adapter uses of the run (a part of the run's own package: private members included)."""

    step: int
    config: RunConfig
    events: EventLog
    watchdog: Watchdog | NoWatchdog
    _loop: StepLoop
    _group: GroupParts | None
    _preemption: PreemptionHandler

    @property
    def _context(self) -> WorkerContext: ...

    @property
    def _parts(self) -> GroupParts: ...

    def _rebuild_on_group(self, ctx: WorkerContext, earlier: CheckpointManager | None) -> None: ...

    def _ballot(self) -> tuple[bool, bool, bool, int]: ...


class SurvivorsHost:
    """What the survivors plug-in reaches of a `Run` (its `RunHost`): kept off `Run`'s public surface."""

    def __init__(self, run: HostedRun) -> None:
        self._run = run

    @property
    def ctx(self) -> WorkerContext:
        return self._run._context

    @property
    def step(self) -> int:
        return self._run.step

    @step.setter
    def step(self, value: int) -> None:
        self._run.step = value

    @property
    def checkpoints(self) -> CheckpointManager:
        return self._run._parts.checkpoints

    @property
    def events(self) -> EventLog:
        return self._run.events

    @property
    def watchdog(self) -> Watchdog | NoWatchdog:
        return self._run.watchdog

    def count_due_from(self, step: int) -> None:
        self._run._loop.due_after = step

    def rebuild_on_group(self, ctx: WorkerContext, earlier: CheckpointManager | None) -> None:
        self._run._rebuild_on_group(ctx, earlier)

    def drop_group_parts(self) -> None:
        run = self._run
        if run._group is not None:
            run._group.drop(run._ballot, run.config)

    def stopping(self) -> bool:
        return self._run._preemption.signalled

    def forget_loss(self) -> None:
        self._run._loop.loss = None
