"""The step loop of `elastic.Run`: one of the parts a `Run` is composed of.

`StepLoop` runs `Run.batches` and the bookkeeping of every step, and owns
what only the loop changes: the loss read one step late, the step report,
the optimizer steps counted, where `due` counts from and the loop's seconds.
The run's shared state (`RunCore`, elastic._worker.run.core) holds the
rest: the worker's context, the sampler, the per-group parts (the step
vote and the checkpoint manager, elastic._worker.run.group), the watchdog,
the fault hook and the loop parts (elastic._worker.run.parts: `--slow-ranks`,
the integrity checks, under TORCHREVIVE_SURVIVORS the survivors' group
changes, and any part a script adds; they answer a step's end with a `Change`).

Invariants:
- A step's bookkeeping runs when the loop asks for the next batch, i.e. after
  the body's `optimizer.step()` and `scheduler.step()`: the sampler advances,
  the previous step's loss is read (one step late: the host never waits on
  the device), on a vote step (about once a second) the vote's verdict is
  read (elastic._worker.control.step_vote: the vote the vote step before started; SIGTERM on
  any rank: every rank commits this step and leaves with `Preempted`, status
  143), a save or snapshot starts, workers waiting to join are taken in
  (train-on), and only then the watchdog is fed: a slow save never looks like
  a hang, a hang inside a save is still caught.
- A loader passed to `batches` is iterated with the caller's random streams
  untouched (its workers' seeds are drawn from a forked generator), and its
  workers die with the trainer (fork-started workers, on Linux) and ignore the
  group's SIGTERM (`elastic._worker.data.feed.SafeWorkerInit`). If it is driven by
  `batch_sampler()` / `sampler_for_loader()`, every step checks the batch it
  yields is the sampler's; after the group changed size in place, the loader
  starts again at the new rank and world size (`elastic._worker.data.feed.Feed`).
- A void step (a peer died in its gradient all-reduce) trains again after the
  group healed: the same batch on a group of the same ranks, this rank's new
  share of the step on a smaller or larger one.
- Leaving `batches` with `break` after the body's `optimizer.step()` counts
  that step as done (data position and step advance), so the final checkpoint
  matches the weights it holds.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from typing import Any, Protocol, TypeVar

import torch

from elastic._shared.common.errors import UsageError, first_line
from elastic._worker.data.feed import Feed
from elastic._worker.observe.step_report import StepReport
from elastic._worker.run.epochs import StepLimit
from elastic._worker.run.parts import Kind, Parts
from elastic._worker.runtime.rng import seed_step
from elastic._shared.protocol.fault_hook import FaultHook
from elastic._worker.config import RunConfig
from elastic._worker.control.step_vote import Verdict
from elastic._worker.control.watchdog import NoWatchdog, Watchdog
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.observe.events import EventLog
from elastic._worker.observe.slow_ranks import SlowRanks
from elastic._worker.observe.step_costs import StepCosts
from elastic._worker.run.group import GroupParts
from elastic._worker.runtime.context import WorkerContext

logger = logging.getLogger(__name__)

Batch = TypeVar("Batch")


class LoopCore(Protocol):
    """What the loop works on of the run's shared state (`RunCore`, elastic._worker.run.core: public members)."""

    config: RunConfig
    step: int
    step_costs: StepCosts
    stack: ExitStack
    events: EventLog
    watchdog: Watchdog | NoWatchdog
    faults: FaultHook
    parts: Parts
    slow_ranks: SlowRanks | None
    sampler: ElasticSampler | None
    tokens_per_sample: int

    @property
    def context(self) -> WorkerContext: ...

    @property
    def group_parts(self) -> GroupParts: ...

    def sampler_checked(self) -> ElasticSampler: ...

    def act_on(self, verdict: Verdict) -> None: ...


class StepLoop:
    """`Run.batches` and each step's bookkeeping (see the module docstring); a part of one `Run`."""

    def __init__(self, core: LoopCore) -> None:
        self.core = core
        self.report: StepReport | None = None
        self.loss: torch.Tensor | None = None
        self.optimizer_steps = 0
        """Counted by the optimizer's post-step hook: tells a `break` after optimizer.step() from one before it."""
        self.seconds = 0.0
        """Time spent inside `batches` by this process (the run's steps_per_s)."""
        self._stepped_before: int | None = None
        """The optimizer steps counted when the step in the script's hands began (None: no step is)."""
        self.stopped = False
        """A loop part answered `Change.STOP` (on every rank at the same step): no more steps."""
        self.due_after = 0
        """`due(n)` is true only past this step: not at the step a restart resumed from (evaluated before
        the failure), nor again at the step of a void step trained again; a worker joining a group at a
        step's bookkeeping counts from the step before, as the members that go on to that step's `due`."""

    def batches(self, loader: Iterable[Batch] | None, limit: StepLimit) -> Iterator[Batch]:
        core = self.core
        ctx = core.context
        sampler = core.sampler_checked()
        self.reporter().start_loop(
            total=limit.last_step(core.step, sampler, ctx.world_size), initial=core.step, enabled=ctx.is_main,
            log_every=core.config.log_every, per_step=sampler.batch_size * ctx.world_size * (core.tokens_per_sample or 1),
            unit="tokens" if core.tokens_per_sample else "samples",
        )
        feed = Feed(loader if not limit.done(core.step, sampler) else None, sampler.batch_size)
        if core.slow_ranks is not None and core.slow_ranks.rebalancing and not feed.takes_shares:
            raise UsageError(f"--slow-ranks {core.config.slow_ranks} needs the loader driven by run.batch_sampler() "
                             "(its batches change size with the ranks' shares) or run.batches() without a loader")
        started = time.perf_counter()
        try:
            yield from self._steps(feed, limit)
        finally:
            self.seconds += time.perf_counter() - started

    def _steps(self, feed: Feed, limit: StepLimit) -> Iterator[Any]:
        core = self.core
        sampler, costs = core.sampler, core.step_costs
        again: Any = None  # a void step's batch, trained again on a group of the same ranks
        core.parts.loop_started(core.step, resizable=feed.resizable)
        while not self.stopped and not limit.done(core.step, sampler):  # the sampler's position: after any resize
            ctx = core.context
            core.parts.before_step(core.step)  # (--slow-ranks: this rank's own work from here to the gradient all-reduce)
            with costs.timing("sampler"):
                expected = sampler.local_batch(ctx.rank, ctx.world_size)
            batch: Any = again
            if again is None:  # the loader's own time is the script's, its check the runtime's
                batch = feed.fetch(expected, step=core.step, until=limit.describe())
                with costs.timing("sampler"):
                    feed.check(expected, step=core.step, rank=ctx.rank)
            again = None
            with costs.timing("sampler"):  # the step's random streams, a function of (seed, step, rank) alone
                seed_step(core.config.seed, core.step + 1, (ctx.rank + sampler.rotation) % ctx.world_size, ctx.device)
            self._stepped_before = self.optimizer_steps
            core.watchdog.step_began(core.step + 1)  # this rank enters the step's collectives (its hang record)
            try:
                yield batch
            except GeneratorExit:  # the loop left with `break`
                if self.optimizer_steps != self._stepped_before:  # ... after training on this batch
                    self.count_step()
                raise
            finally:
                self._stepped_before = None
            step, place = core.step, (ctx.rank, ctx.world_size)
            if core.parts.body_ended(step).kind is not Kind.VOID:
                resized = self._end_step()
            else:  # the step did not happen (the survivors healed the group): not counted
                resized = (core.context.rank, core.context.world_size) != place
                if not resized and core.step == step:
                    again = batch  # else it took the state of this very step from a peer that completed it
            if resized:  # this rank's share of the steps to come is another: the loader starts again
                feed.reopen(core.context.rank, core.context.world_size)
        self.flush_report()

    def before_update(self) -> bool:
        """Whether the script holds a step's batch and has not made its optimizer step yet."""
        return self._stepped_before is not None and self.optimizer_steps == self._stepped_before

    def count_optimizer_step(self) -> None:
        self.optimizer_steps += 1

    def log(self, loss: torch.Tensor | float) -> None:
        self.loss = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))

    def count_step(self) -> None:
        """This rank's part of a step's end: data position, step count, the loss read-outs."""
        core = self.core
        costs = core.step_costs
        with costs.timing("sampler"):
            core.sampler.advance(core.context.world_size)
        core.step += 1
        costs.steps += 1
        self.reporter().record(core.step, self.loss)
        self.loss = None

    def _end_step(self) -> bool:
        """The step's bookkeeping (see the module docstring); True when the group changed size, when
        every rank rolled back to an earlier step (elastic._worker.integrity: the feed opens again there),
        or when the ranks' shares of the global batch changed (--slow-ranks rebalance)."""
        self.count_step()
        core = self.core
        costs = core.step_costs
        resized = rebalanced = False
        try:
            rewind = core.parts.step_ended(core.step)  # before saves: a step is saved only once its check passed
            if rewind.to is not None:  # every rank went back to an earlier step (a rollback)
                core.step = rewind.to
                core.group_parts.vote.rewound()  # votes follow the step count: the replay's first step end votes
                return True
            with costs.timing("vote"):
                if core.group_parts.vote.votes_at(core.step):
                    core.faults.at("during_vote", core.step)
                verdict = core.group_parts.vote.step_ended(core.step)
                change = core.parts.after_step(core.step, verdict.slots)
                rebalanced = change.kind is Kind.RESHARD  # new shares: the loader opens again
                self.stopped = self.stopped or change.kind is Kind.STOP
            core.act_on(verdict)
            with costs.timing("checkpoint"):  # the snapshot parts are moved out of it in `finish`
                core.group_parts.checkpoints.maybe_save(core.step)
            done = core.parts.step_done(core.step)  # (train-on: workers waiting to join are taken in here)
            resized = done.kind is Kind.RESHARD
            self.stopped = self.stopped or done.kind is Kind.STOP
        except RuntimeError as error:  # a collective of the bookkeeping (a replica check's too) met the dead peer first
            failure: RuntimeError | None = error
        else:
            failure = None
        if failure is not None:  # offered to the parts out of the `except` block (a heal makes collectives of its own)
            healed = core.parts.collective_failed(first_line(failure))
            if healed is None:  # no part heals it: the error stands
                raise failure
            resized = healed.kind is Kind.RESHARD
        with costs.timing("watchdog"):
            core.faults.at("after_step", core.step)
            core.watchdog.beat(core.step)
        return resized or rebalanced

    def reporter(self) -> StepReport:
        if self.report is None:
            core = self.core
            self.report = StepReport(core.events, core.step_costs, world_size=core.context.world_size)
            core.stack.callback(self.report.close)
        return self.report

    def print(self, message: str, *, main: bool) -> None:
        """A line on rank 0's console that does not tear the progress bar."""
        if self.report is not None and self.report.progress is not None:
            self.report.progress.write(message)
        elif main:
            logger.info("%s", message)

    def flush_report(self) -> None:
        if self.report is not None:
            self.report.flush()

    @property
    def last_loss(self) -> float:
        return self.report.last_loss if self.report is not None else math.nan

    def summary(self, rank: int, first_step: int, snapshot_seconds: dict[str, float]) -> dict[str, Any]:
        """`Run.finish`'s summary: rank, step, loss (the last read), steps_per_s (of this process's loop since
        `first_step`), step_costs (the snapshot's parts of "checkpoint" added as their own phases)."""
        core = self.core
        for phase, spent in snapshot_seconds.items():
            core.step_costs.add(phase, spent)
        steps, seconds = core.step - first_step, self.seconds
        return {"rank": rank, "step": core.step, "loss": self.last_loss,
                "steps_per_s": steps / seconds if seconds > 0 else math.inf, "step_costs": core.step_costs.per_step()}

    def due(self, every: int) -> bool:
        return every > 0 and self.core.step > self.due_after and self.core.step % every == 0
