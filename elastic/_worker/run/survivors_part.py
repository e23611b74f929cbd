"""The survivors plug-in (elastic._worker.survivors.plugin) as a part of the step loop, and what it
reaches of a run.

- `SurvivorsPart` is a loop part (elastic._worker.run.parts) like the others: a step whose gradient
  all-reduce failed is answered VOID at its body's end (healed in place first), a collective of the
  bookkeeping that failed is healed when offered, and with train-on the newest ticket of a worker
  waiting to join rides on the step vote as the part's one slot (rank 0's reading; every rank learns
  it at the same vote step) and the group grows once the step's saves started.
- `SurvivorsHost` is the plug-in's `RunHost`: an adapter over the run's shared state (`RunCore`), so
  that nothing on `Run`'s public surface exists only for the survivors: the plug-in sets the step a new
  group goes on from, where `due` counts from, rebuilds the group's parts and drops them before a group
  is left.

Invariant: every rank of a group answers alike at the same step: a void step is void on every rank
(the failed all-reduce fails everywhere), and a grow happens at the step end after the vote step that
carried the ticket, on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from elastic._shared.common.errors import UsageError
from elastic._worker.checkpoint import CheckpointManager
from elastic._worker.control.watchdog import NoWatchdog, Watchdog
from elastic._worker.observe.events import EventLog
from elastic._worker.run.core import RunCore
from elastic._worker.run.parts import Change, LoopPartBase
from elastic._worker.runtime.context import WorkerContext
from elastic._worker.survivors.healing import StepStart
from elastic._worker.survivors.plugin import Survivors


class SurvivorsPart(LoopPartBase):
    """The survivors' group changes at the loop's hooks (see the module docstring)."""

    def __init__(self, survivors: Survivors, core: RunCore) -> None:
        self.survivors, self._core = survivors, core
        self._started: StepStart | None = None  # what a void step's undo puts back (None: not healing)
        self._ticket_reader: Callable[[], int] | None = None  # the group's rank 0 reads the newest ticket
        self._newest_ticket = 0  # the newest joiner ticket any vote carried

    def on_group(self, ctx: WorkerContext) -> None:
        self._ticket_reader = self.survivors.joiners_waiting(ctx)
        self.survivors.on_new_group(ctx, self._core.events, self._core.config.events)

    def loop_started(self, step: int, *, resizable: bool) -> None:
        if self.survivors.train_on and not resizable:
            raise UsageError("--survivors train-on needs the loader driven by run.batch_sampler() or "
                             "run.sampler_for_loader(): after a resize each rank takes its new share from it")

    def before_step(self, step: int) -> None:
        survivors = self.survivors
        self._started = survivors.before_step(self._core.context.device) if survivors.can_heal else None

    def body_ended(self, step: int) -> Change:
        """A step whose gradient all-reduce failed on this rank: heal, then VOID (the loop tells from the
        step count and this rank's place whether to train its batch again)."""
        started, self._started = self._started, None
        survivors = self.survivors
        if started is None or not survivors.void:
            return Change.NONE
        survivors.failed(started, survivors.void_reason)
        return Change.VOID

    def ballot_size(self, world_size: int) -> int:
        return 1 if self.survivors.train_on else 0

    def ballot(self) -> Sequence[int]:
        return [self._ticket_reader() if self._ticket_reader is not None else 0]

    def after_step(self, step: int, ballots: tuple[int, ...] | None) -> Change:
        if ballots:
            self._newest_ticket = max(self._newest_ticket, ballots[0])
        return Change.NONE

    def step_done(self, step: int) -> Change:
        """Workers wait to join (tickets up to the newest the vote carried, not considered yet): take them in now."""
        survivors = self.survivors
        if survivors.grow_due(self._newest_ticket) and survivors.grow(self._newest_ticket):
            return Change.RESHARD
        return Change.NONE

    def collective_failed(self, why: str) -> Change | None:
        if not self.survivors.can_heal:
            return None
        return Change.RESHARD if self.survivors.failed(None, why) else Change.NONE


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
        """SIGTERM came. A train-on joiner waits to be admitted in `Run.start`, before the run's SIGTERM
        handler is installed: until then, nothing stops it but its agent (the soak: a view that broke
        while a joiner formed it asked this, and the joiner died of an AssertionError, a round later)."""
        preemption = self._core.preemption
        return preemption is not None and preemption.signalled

    def forget_loss(self) -> None:
        self._core.loop.loss = None
