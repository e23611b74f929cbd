"""What the survivors plug-in reaches of a run: its `RunHost` (elastic._worker.survivors.plugin).

An adapter over the run's shared state (`RunCore`), so that nothing on `Run`'s public surface exists
only for the survivors: the plug-in sets the step a new group goes on from, where `due` counts from,
rebuilds the group's parts and drops them before a group is left.
"""

from __future__ import annotations

from elastic._worker.checkpoint import CheckpointManager
from elastic._worker.control.watchdog import NoWatchdog, Watchdog
from elastic._worker.observe.events import EventLog
from elastic._worker.run.core import RunCore
from elastic._worker.runtime.context import WorkerContext


class SurvivorsHost:
    """What the survivors plug-in reaches of a run (its `RunHost`): kept off `Run`'s public surface."""

    def __init__(self, core: RunCore) -> None:
        self._core = core

    @property
    def ctx(self) -> WorkerContext:
        return self._core.context

    @property
    def step(self) -> int:
        return self._core.step

    @step.setter
    def step(self, value: int) -> None:
        self._core.step = value

    @property
    def checkpoints(self) -> CheckpointManager:
        return self._core.group_parts.checkpoints

    @property
    def events(self) -> EventLog:
        return self._core.events

    @property
    def watchdog(self) -> Watchdog | NoWatchdog:
        return self._core.watchdog

    def count_due_from(self, step: int) -> None:
        self._core.loop.due_after = step

    def rebuild_on_group(self, ctx: WorkerContext, earlier: CheckpointManager | None) -> None:
        self._core.rebuild_on_group(ctx, earlier)

    def drop_group_parts(self) -> None:
        self._core.drop_group_parts()

    def stopping(self) -> bool:
        return self._core.signals.signalled

    def forget_loss(self) -> None:
        self._core.loop.loss = None
