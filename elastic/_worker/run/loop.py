"""The step loop of `elastic.Run` (a part of the class, kept in a module of its own).

`StepLoop` holds `Run.batches` and the bookkeeping of every step; `Run`
(elastic._worker.run.run) inherits it and owns the state it works on: the worker's
context, the sampler, the step vote, the checkpoint manager, the watchdog,
the fault hook and, under TORCHREVIVE_SURVIVORS, the survivors' side of a
group that changes in place (elastic._worker.survivors.plugin).

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

import math
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch

from elastic._shared.common.errors import CheckpointStorageError, UsageError, first_line
from elastic._worker.control.step_vote import Verdict
from elastic._worker.data.feed import Feed
from elastic._worker.observe.step_report import StepReport
from elastic._worker.survivors.plugin import Survivors

Batch = TypeVar("Batch")


class StepLoop:
    """`Run.batches` and each step's bookkeeping (see the module docstring); mixed into `elastic.Run`."""

    # Owned by `Run`, which sets them in __init__, __enter__ and start.
    step: int
    config: Any
    sampler: Any
    checkpoints: Any
    watchdog: Any
    step_costs: Any
    _healing: Any
    due_after: int
    _survivors: Survivors | None
    _report: StepReport | None

    def batches(self, loader: Iterable[Batch] | None = None, *, max_steps: int) -> Iterator[Batch]:
        """This rank's batch of each step until `max_steps` steps are done.

        Without `loader`, the batch is this rank's sample indices (a tensor).
        The step's bookkeeping runs when the next batch is asked for (see the
        module docstring); a `break` after the body's optimizer step counts that step
        as done, a `break` before it leaves the step untrained.
        """
        ctx = self._context
        self._sampler_checked()
        self._reporter().start_loop(
            total=max_steps, initial=self.step, enabled=ctx.is_main, log_every=self.config.log_every,
            per_step=self.sampler.batch_size * ctx.world_size * (self._tokens_per_sample or 1),
            unit="tokens" if self._tokens_per_sample else "samples",
        )
        feed = Feed(loader if self.step < max_steps else None, self.sampler.batch_size)
        if self._healing is not None and self._healing.train_on and not feed.resizable:
            raise UsageError("TORCHREVIVE_SURVIVORS=train-on needs the loader driven by run.batch_sampler() or "
                             "run.sampler_for_loader(): after a resize each rank takes its new share from it")
        self._loop_started = time.perf_counter()
        try:
            yield from self._steps(feed, max_steps)
        finally:
            self._loop_seconds += time.perf_counter() - self._loop_started

    def _steps(self, feed: Feed, max_steps: int) -> Iterator[Any]:
        sampler, costs = self.sampler, self.step_costs
        again: Any = None  # a void step's batch, trained again on a group of the same ranks
        while self.step < max_steps:
            ctx = self._context
            with costs.timing("sampler"):
                expected = sampler.local_batch(ctx.rank, ctx.world_size)
            batch: Any = again
            if again is None:  # the loader's own time is the script's, its check the runtime's
                batch = feed.fetch(expected, step=self.step, max_steps=max_steps)
                with costs.timing("sampler"):
                    feed.check(expected, step=self.step, rank=ctx.rank)
            again = None
            healing = self._healing if self._survivors is not None and self._healing.ready else None
            started = healing.before_step(ctx.device, self._optimizer, self._scheduler, self._scaler) if healing else None
            stepped_before = self._optimizer_steps
            try:
                yield batch
            except GeneratorExit:  # the loop left with `break`
                if self._optimizer_steps != stepped_before:  # ... after training on this batch
                    self._count_step()
                raise
            if healing is None or not healing.void:
                resized = self._end_step()
            else:
                step = self.step
                resized = self._in_place().failed(started, healing.guard.error)
                if not resized and self.step == step:
                    again = batch  # else it took the state of this very step from a peer that completed it
            if resized:  # this rank's share of the steps to come is another: the loader starts again
                feed.reopen(self.rank, self.world_size)
        self._report_pending()

    def _in_place(self) -> Survivors:
        assert self._survivors is not None
        return self._survivors

    def log(self, loss: torch.Tensor | float) -> None:
        """The loss of the step being trained; read out one step later (no device sync now)."""
        self._loss = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))

    def _count_step(self) -> None:
        """This rank's part of a step's end: data position, step count, the loss read-outs."""
        costs = self.step_costs
        with costs.timing("sampler"):
            self.sampler.advance(self._context.world_size)
        self.step += 1
        costs.steps += 1
        self._reporter().record(self.step, self._loss)
        self._loss = None

    def _end_step(self) -> bool:
        """The step's bookkeeping (see the module docstring); True when the group changed size."""
        self._count_step()
        costs = self.step_costs
        resized = False
        try:
            with costs.timing("vote"):
                verdict = self._vote.step_ended(self.step)
            self._act_on(verdict)
            with costs.timing("checkpoint"):  # the snapshot parts are moved out of it in `finish`
                self.checkpoints.maybe_save(self.step)
            healing = self._healing
            if healing is not None and healing.train_on and verdict.joiners > healing.view.considered:
                resized = self._in_place().grow(verdict.joiners)  # workers wait to join: take them in now
        except RuntimeError as error:  # a collective of the bookkeeping met the dead peer first
            if self._survivors is None or not self._healing.ready:
                raise
            why = first_line(error)
        else:
            why = None
        if why is not None:  # healed out of the `except` block (see `Survivors.failed`)
            resized = self._in_place().failed(None, why)
        with costs.timing("watchdog"):
            self._faults.at("after_step", self.step)
            self.watchdog.beat(self.step)
        return resized

    def _act_on(self, verdict: Verdict) -> None:
        """What every rank does with the step vote's verdict, at the same step."""
        self.checkpoints.agree_snapshot_interval(verdict.snapshot_every, self.step)
        if verdict.preempted:  # SIGTERM on any rank: commit this step, then leave
            self._preemption.at_boundary()  # the checkpoint that follows may take its time
            self._report_pending()
            self._commit_and_stop(requeue=verdict.requeue)
        if verdict.storage_failing:  # rank 0's saves keep failing: stop before more work is lost
            self._report_pending()
            raise CheckpointStorageError(self.checkpoints.share_stop_reason())

    def _reporter(self) -> StepReport:
        if self._report is None:
            self._report = StepReport(self.events, self.step_costs, world_size=self._context.world_size)
            self._stack.callback(self._report.close)
        return self._report

    def _report_pending(self) -> None:
        if self._report is not None:
            self._report.flush()

    @property
    def last_loss(self) -> float:
        """The newest loss read (one step late; nan before any)."""
        return self._report.last_loss if self._report is not None else math.nan

    def due(self, every: int) -> bool:
        """Whether the step just done by this run is a multiple of `every` (0: never)."""
        return every > 0 and self.step > self.due_after and self.step % every == 0
