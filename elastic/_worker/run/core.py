"""What the parts of one run share: `RunCore`, the run's state with every member public.

`elastic.Run` is the front door a script talks to; behind it, the step loop (loop.py), the survivors'
part and adapter (survivors_part.py), the opening and the end of a run (opening.py, closing.py) and every loop
part (parts.py) work on one `RunCore`. None of them reaches into `Run`: the core is their meeting
point, and `Run` only hands the script's calls to it.

Invariants:
- `ctx` is the worker's place in the current process group; `group` holds the parts built on that
  group (the step vote and the checkpoint manager) and is rebuilt, with the loop parts told first,
  whenever the group changes (`rebuild_on_group`).
- `step` counts the steps the whole job completed (restored ones included); only the loop, a heal
  and a rollback change it.
- Members set by `Run.start` (`model`, `sampler`, `state`, `integrity`, `slow_ranks`, `faults`,
  `preemption`) exist only once `started` is true.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import TYPE_CHECKING

from elastic._shared.common.errors import CheckpointStorageError
from elastic._shared.protocol.fault_hook import NO_FAULTS, FaultHook
from elastic._worker.checkpoint import CheckpointManager
from elastic._worker.config import RunConfig
from elastic._worker.control.preemption import PreemptionHandler
from elastic._worker.control.step_vote import Ballot, Verdict
from elastic._worker.control.watchdog import NoWatchdog, Watchdog
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.integrity.loop_part import Integrity
from elastic._worker.observe.events import EventLog
from elastic._worker.observe.slow_ranks import SlowRanks
from elastic._worker.observe.step_costs import StepCosts
from elastic._worker.run.group import GroupParts, RegisteredState
from elastic._worker.run.loop import StepLoop
from elastic._worker.run.parts import LoopPart, Parts
from elastic._worker.run.stopping import commit_and_stop
from elastic._worker.runtime.context import WorkerContext
from elastic._worker.survivors.plugin import Survivors

if TYPE_CHECKING:
    import torch


class RunCore:
    """One run's shared state (see the module docstring)."""

    def __init__(self, config: RunConfig, parts: list[LoopPart]) -> None:
        self.config = config
        self.ctx: WorkerContext | None = None
        self.step = 0
        """Steps completed by the whole job (restored ones included)."""
        self.first_step = 0
        """The step this process's loop started from (its summary's steps_per_s counts from it)."""
        self.step_costs = StepCosts()
        self.stack = ExitStack()
        """What leaving the run closes, in reverse order: saves in flight, SIGTERM's handler, metrics, the log."""
        self.owns_group = False
        self.started = self.finished = False
        self.leaving_failed = False
        self.parts = Parts(parts)
        """The loop parts, in the order the loop calls them (the --slow-ranks part is added by `Run.start`)."""
        self.loop = StepLoop(self)
        """`Run.batches` and each step's bookkeeping (elastic._worker.run.loop)."""
        self.group: GroupParts | None = None
        self.survivors: Survivors | None = None
        """The survivors plug-in, under torchrevive-run --survivors keep|train-on."""
        self.events = EventLog(None, restart=0)
        """The event log (rank 0's file; opened by `Run.__enter__`: until then, one that writes nothing)."""
        self.watchdog: Watchdog | NoWatchdog = NoWatchdog()
        """Armed by the first step (made by `Run.__enter__`)."""
        self.faults: FaultHook = NO_FAULTS
        self.tokens_per_sample = 0
        self.model: torch.nn.Module | None = None
        self.sampler: ElasticSampler | None = None
        self.state: RegisteredState | None = None
        self.integrity: Integrity | None = None
        self.slow_ranks: SlowRanks | None = None
        """--slow-ranks (its loop part is in `parts`; the loop asks it whether the loader must take shares)."""
        self.preemption: PreemptionHandler | None = None

    @property
    def context(self) -> WorkerContext:
        if self.ctx is None:
            raise RuntimeError("use the Run as a context manager: `with elastic.Run(...) as run:`")
        return self.ctx

    @property
    def group_parts(self) -> GroupParts:
        assert self.group is not None, "built in Run.start"
        return self.group

    @property
    def signals(self) -> PreemptionHandler:
        assert self.preemption is not None, "installed by Run.start"
        return self.preemption

    def sampler_checked(self) -> ElasticSampler:
        if not self.started or self.sampler is None:
            raise RuntimeError("call Run.start() first")
        return self.sampler

    @property
    def checkpoints(self) -> CheckpointManager | None:
        return self.group.checkpoints if self.group is not None else None

    def rebuild_on_group(self, ctx: WorkerContext, earlier: CheckpointManager | None) -> None:
        """The default group is new (or the first): tell the loop parts, then build the step vote and the
        checkpoint manager on it, taking over from `earlier`."""
        self.ctx = ctx
        self.parts.on_group(ctx)
        assert self.state is not None, "registered by Run.start"
        self.group = GroupParts.build(
            ctx, self.config, self.state, ballot=self.ballot, events=self.events, faults=self.faults,
            earlier=earlier, slots=self.parts.ballots, integrity=self.integrity,
        )
        report = self.loop.report
        if report is not None and self.sampler is not None:
            report.resize(ctx.world_size, self.sampler.batch_size * ctx.world_size * (self.tokens_per_sample or 1))

    def ballot(self) -> Ballot:
        """This rank's ballot on the step vote."""
        signals, checkpoints = self.signals, self.group_parts.checkpoints
        return Ballot(preempted=signals.signalled, requeue=signals.requeue_signalled,
                      storage_failing=checkpoints.must_stop, snapshot_every=checkpoints.snapshot_proposal())

    def act_on(self, verdict: Verdict) -> None:
        """What every rank does with the step vote's verdict, at the same step (the loop calls it)."""
        checkpoints = self.group_parts.checkpoints
        checkpoints.agree_snapshot_interval(verdict.snapshot_every, self.step)
        if verdict.preempted:  # SIGTERM on any rank: commit this step, then leave
            self.signals.at_boundary()  # the checkpoint that follows may take its time
            self.flush_report()
            commit_and_stop(checkpoints, self.watchdog, self.context, self.step, requeue=verdict.requeue)
        if verdict.storage_failing:  # rank 0's saves keep failing: stop before more work is lost
            self.flush_report()
            raise CheckpointStorageError(checkpoints.share_stop_reason())

    def flush_report(self) -> None:
        self.loop.flush_report()

    def drop_group_parts(self) -> None:
        """Before the group is left: the vote in flight is dropped and saves in flight abandoned."""
        if self.group is not None:
            self.group.drop(self.ballot, self.config)
