"""`elastic.Run`: the one object a training script talks to.

    with elastic.Run.from_args(args) as run:                      # every rank: joins the job
        model = run.ddp(Net().to(run.device))
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        run.start(model=model, optimizer=optimizer, data=dataset, batch_size=args.batch_size)
        loader = DataLoader(dataset, batch_sampler=run.batch_sampler(), num_workers=2)
        for x, y in run.batches(loader, max_steps=args.max_steps):
            loss = loss_fn(model(x.to(run.device)), y.to(run.device))
            optimizer.zero_grad(); loss.backward(); optimizer.step()
            run.log(loss)
    # leaving the block: final checkpoint, replica check, "end" event

What is saved, at every `--ckpt-every` step, on SIGTERM and at the end: the
model, the optimizer, the scheduler and grad scaler if given, each `extra`
object, the data position (the elastic sampler: how many samples of which
epoch the whole job consumed), the step, and every rank's RNG states. A
restarted worker, at the same or another world size, continues from the
newest checkpoint that verifies: same samples, same random numbers.

Invariants (the ordering rules a recipe used to keep by hand):
- Every rank makes the same calls in the same order: `start`, each step of
  `batches`, `pause` blocks, `finish` are collectives.
- `Run.__enter__` joins the process group (or adopts one the script already
  made) and seeds every generator with `seed` on every rank, so the model
  built next starts identical everywhere. `start` then gives each rank its own
  random stream (`seed + rank`), serves metrics, restores, and only then
  counts the run as started: a scrape sees the restore, a kill during restore
  loses nothing.
- A step's bookkeeping runs when the loop asks for the next batch, i.e. after
  the body's `optimizer.step()` and `scheduler.step()`: the sampler advances,
  the previous step's loss is read (one step late: the host never waits on
  the device), on a vote step (about once a second) the vote's verdict is
  read (elastic.step_vote: the vote the vote step before started; SIGTERM on
  any rank: every rank commits this step and leaves with `Preempted`, status
  143), a save or snapshot starts, and
  only then the watchdog is fed: a slow save never looks like a hang, a hang
  inside a save is still caught.
- Saves block the loop only to copy the state; writing runs behind the next
  steps, and a save due while the previous one is still being written is
  skipped. `finish` and a preemption block until the checkpoint is committed
  (within `ckpt_timeout`, in slices that keep every collective short).
- A failed save is a warning, an event and a metric, and training goes on.
  After `ckpt_max_failures` in a row (the vote carries rank 0's verdict), or
  when the final or preemption save fails, every rank raises
  `CheckpointStorageError` (exit status 75) at the same step; the committed
  checkpoints are intact.
- `pause()` marks work that is not a training step (evaluation, sampling):
  the watchdog does not count it, a SIGTERM during it waits for its end, and
  the preemption vote taken then commits the step (a collective).
- A loader passed to `batches` is iterated with the caller's random streams
  untouched (its workers' seeds are drawn from a forked generator), and its
  workers die with the trainer (fork-started workers, on Linux) and ignore the
  group's SIGTERM (`elastic.data.SafeWorkerInit`). If it is driven by
  `batch_sampler()` / `sampler_for_loader()`, every step checks the batch it
  yields is the sampler's.
- Leaving `batches` with `break` after the body's `optimizer.step()` counts
  that step as done (data position and step advance), so the final checkpoint
  matches the weights it holds.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from elastic import fault_hook, parallel
from elastic.checkpoint import CheckpointManager
from elastic.checkpoint.training_state import Stateful
from elastic.cli import configure_logging
from elastic.config import RunConfig
from elastic.data import StepBatchSampler, StepSampler, check_batch, next_batch, open_loader
from elastic.errors import CheckpointStorageError, ElasticError, Preempted, first_line
from elastic.events import EventLog
from elastic.healing import Healing
from elastic.regroup import GroupBroken, RegroupError
from elastic.metrics import start_metrics
from elastic.parallel import unwrap
from elastic.preemption import PreemptionHandler
from elastic.replicas import gather_digests, parameter_digest
from elastic.rng import seed_all
from elastic.runtime import (
    WorkerContext,
    adopt_worker,
    barrier,
    init_worker,
    shutdown_worker,
)
from elastic.sampler import ElasticSampler
from elastic.slurm.requeue import after_preemption_commit, preemption_settings
from elastic.step_costs import StepCosts
from elastic.step_report import StepReport
from elastic.step_vote import StepVote, Verdict
from elastic.watchdog import NoWatchdog, Watchdog, watchdog

logger = logging.getLogger(__name__)

Batch = TypeVar("Batch")

_CATCH_UP_ATTEMPTS = 3
"""Heals in a row a worker starts over when members die during the catch-up (then exit status 76)."""


class Run:
    """A fault-tolerant training run of this worker; see the module docstring."""

    def __init__(self, config: RunConfig | None = None, **settings: Any) -> None:
        if config is not None and settings:
            raise TypeError("pass a RunConfig or keyword settings, not both")
        self.config = config if config is not None else RunConfig(**settings)
        self.ctx: WorkerContext | None = None
        self.step = 0
        """Steps completed by the whole job (restored ones included)."""
        self._stack = ExitStack()
        self._owns_group = False
        self._started = self._finished = False
        self._loss: torch.Tensor | None = None
        self._loop_started: float | None = None
        self._loop_seconds = 0.0
        self._first_step = 0
        self._leaving_failed = False
        self.step_costs = StepCosts()
        """Seconds per phase of the runtime's per-step work (elastic.step_costs)."""
        self._report: StepReport | None = None
        self._healing: Healing | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Run:
        return cls(RunConfig.from_args(args))

    # -- who and where -------------------------------------------------------------

    def __enter__(self) -> Run:
        cfg = self.config
        if not logging.getLogger().handlers:  # a script that set up no logging still sees progress
            rank = os.environ.get("RANK", "")
            configure_logging(rank=int(rank) if rank.isdigit() else None)
        timeout = timedelta(seconds=cfg.collective_timeout)
        if dist.is_available() and dist.is_initialized():
            self.ctx = adopt_worker(cfg.device, timeout=timeout)
        else:
            # Under torchrevive-run with TORCHREVIVE_SURVIVORS=keep: heals in place (elastic.healing).
            self._healing = Healing.from_environ(os.environ, timeout=timeout)
            store = self._healing.group_store() if self._healing is not None else None
            self.ctx = init_worker(cfg.device, timeout=timeout, store=store)
            self._owns_group = self.ctx.distributed
        try:
            seed_all(cfg.seed, self.ctx.device)  # the model built next is identical on every rank
            self.events = self._stack.enter_context(
                EventLog(cfg.events if self.ctx.is_main else None, restart=self.ctx.restart_count)
            )
            self.watchdog: Watchdog | NoWatchdog = watchdog(cfg.hang_timeout)  # armed by the first step
            self._stack.callback(self.watchdog.close)
        except BaseException:
            self._leave(failed=True)
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        # Preempted and a storage stop are raised on every rank at the same step: they leave together.
        failed = exc_type is not None and not getattr(exc_type, "raised_everywhere", False)
        try:
            if exc_type is None and self._started and not self._finished:
                self.finish()
        except BaseException:
            failed = True
            raise
        finally:
            self._leave(failed=failed)

    def _leave(self, *, failed: bool) -> None:
        self._leaving_failed = failed
        try:
            self._stack.close()  # commits saves in flight, puts SIGTERM back, closes metrics and the log
        except BaseException:
            failed = True
            raise
        finally:
            if self._owns_group:
                left_together = False
                try:
                    if not failed:
                        # Leave together: a rank tearing its gloo pairs down while a peer still
                        # drains the last collective aborts that peer at exit.
                        barrier(self._context)
                        left_together = True
                finally:
                    # On failure (or a failed barrier) peers may be gone: nothing that waits on them.
                    shutdown_worker(failed=not left_together)
                    self._owns_group = False

    @property
    def _context(self) -> WorkerContext:
        if self.ctx is None:
            raise RuntimeError("use the Run as a context manager: `with elastic.Run(...) as run:`")
        return self.ctx

    @property
    def device(self) -> torch.device:
        return self._context.device

    @property
    def rank(self) -> int:
        return self._context.rank

    @property
    def world_size(self) -> int:
        return self._context.world_size

    @property
    def is_main(self) -> bool:
        return self._context.is_main

    @property
    def distributed(self) -> bool:
        return self._context.distributed

    def ddp(self, model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        """`model` under DistributedDataParallel in a job of several processes, as is alone."""
        healing = self._healing
        if healing is not None and healing.replacement:
            kwargs.setdefault("init_sync", False)  # its state comes from a survivor in `start`
        wrapped = parallel.ddp(self._context, model, **kwargs)
        if healing is not None:
            healing.attach(wrapped)
        return wrapped

    def fsdp(
        self,
        model: torch.nn.Module,
        *,
        blocks: Iterable[torch.nn.Module] = (),
        mixed_precision: bool | None = None,
    ) -> torch.nn.Module:
        """`model` sharded with FSDP2 over every rank (see `parallel.fsdp`). Build the optimizer after this call."""
        return parallel.fsdp(self._context, model, blocks=blocks, mixed_precision=mixed_precision)

    # -- state ----------------------------------------------------------------------

    def start(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        data: Any,
        batch_size: int,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        scaler: torch.amp.GradScaler | None = None,
        extra: Mapping[str, Stateful] | None = None,
        tokens_per_sample: int = 0,
    ) -> int:
        """Register the state and restore the newest checkpoint; returns the step to continue from.

        `data`: the training set (or its length); `batch_size`: samples per rank
        per step. `tokens_per_sample` (sequence models) makes throughput count tokens.
        A collective. Raises `CheckpointMismatchError` (one line, nothing
        changed) for a checkpoint of another model, optimizer, data set or state.
        """
        ctx, cfg = self._context, self.config
        if self._started:
            raise RuntimeError("Run.start() was already called")
        self.model = unwrap(model)
        num_samples = data if isinstance(data, int) else len(data)
        self.sampler = ElasticSampler(num_samples, batch_size=batch_size, seed=cfg.seed)
        self._tokens_per_sample = tokens_per_sample
        self._stack.enter_context(  # before restore, so a scrape sees the restore too
            start_metrics(
                ctx, self.events, port=cfg.metrics_port, host=cfg.metrics_host, samples_per_step=batch_size,
                tokens_per_sample=tokens_per_sample, watchdog=self.watchdog,
            )
        )
        self._vote = StepVote(ctx, self._ballot, grace=cfg.term_grace)
        self._optimizer, self._scheduler, self._scaler, self._extra = optimizer, scheduler, scaler, extra
        self.checkpoints = self._new_checkpoint_manager()
        # Leaving on an error, peers may be dead: a save in flight (its writers meet in
        # collectives) gets a few seconds, not --ckpt-timeout.
        self._stack.callback(lambda: self.checkpoints.close(  # a clean end (finished, preempted) lets go
            wait=5.0 if self._leaving_failed else None, ended=not self._leaving_failed))
        self._optimizer_steps = 0  # tells a `break` after optimizer.step() from one before it
        hook = optimizer.register_step_post_hook(lambda *_: self._count_optimizer_step())
        self._stack.callback(hook.remove)
        seed_all(cfg.seed + ctx.rank, ctx.device)  # each rank its own stream (dropout); restore overrides it
        self._preemption = PreemptionHandler(ctx, grace=cfg.term_grace, **preemption_settings(os.environ))
        self._stack.callback(self._preemption.uninstall)
        self._faults = fault_hook.for_worker(ctx.rank, ctx.restart_count)  # ELASTIC_FAULT, for the chaos suite
        healing = self._healing
        if healing is not None and healing.arm(ctx, optimizer) and healing.replacement:
            self.step = self._catch_up(-1, replacement=True)  # the state of a survivor, from its memory
        else:
            self.step = self.checkpoints.restore()
        self._first_step = self.step
        self._started = True
        parameters = sum(p.numel() for p in self.model.parameters())
        self.events.emit(
            "start", step=self.step, world_size=ctx.world_size, run_id=ctx.run_id, parameters=parameters,
            device=str(ctx.device), samples_per_step=batch_size * ctx.world_size,
            **({"tokens_per_step": batch_size * tokens_per_sample * ctx.world_size} if tokens_per_sample else {}),
        )
        if ctx.is_main:
            logger.info(
                "training %.2fM parameters on %d samples, world size %d, device %s, from step %d",
                parameters / 1e6, num_samples, ctx.world_size, ctx.device, self.step,
            )
        return self.step

    def _new_checkpoint_manager(self) -> CheckpointManager:
        return CheckpointManager(
            self._context, self.config, model=self.model, optimizer=self._optimizer, sampler=self.sampler,
            scheduler=self._scheduler, scaler=self._scaler, extra=self._extra, events=self.events,
        )

    def _count_optimizer_step(self) -> None:
        self._optimizer_steps += 1

    def _ballot(self) -> tuple[bool, bool, bool, int]:
        stop, checkpoints = self._preemption, self.checkpoints
        return stop.signalled, stop.requeue_signalled, checkpoints.must_stop, checkpoints.snapshot_proposal()

    @property
    def epoch(self) -> int:
        """The epoch the next step starts in."""
        return self._sampler_checked().epoch

    @property
    def epochs_done(self) -> float:
        """Passes over the data set so far, as a fraction."""
        sampler = self._sampler_checked()
        return sampler.epoch + sampler.state.consumed / sampler.num_samples

    def _sampler_checked(self) -> ElasticSampler:
        if not self._started:
            raise RuntimeError("call Run.start() first")
        return self.sampler

    # -- data -----------------------------------------------------------------------

    def batch_sampler(self) -> StepBatchSampler:
        """For `DataLoader(dataset, batch_sampler=...)`: this rank's share of each step, exactly once per epoch."""
        return StepBatchSampler(self._sampler_checked(), self.rank, self.world_size)

    def sampler_for_loader(self) -> StepSampler:
        """For `DataLoader(dataset, sampler=..., batch_size=B)` with B the batch size given to `start`."""
        return StepSampler(self._sampler_checked(), self.rank, self.world_size)

    # -- the loop -------------------------------------------------------------------

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
        source, issued = open_loader(loader, self.sampler.batch_size) if self.step < max_steps else (None, None)
        self._loop_started = time.perf_counter()
        try:
            yield from self._steps(source, issued, max_steps)
        finally:
            self._loop_seconds += time.perf_counter() - self._loop_started

    def _steps(self, source: Iterator[Any] | None, issued: Any, max_steps: int) -> Iterator[Any]:
        ctx, sampler, costs = self._context, self.sampler, self.step_costs
        while self.step < max_steps:
            with costs.timing("sampler"):
                expected = sampler.local_batch(ctx.rank, ctx.world_size)
            batch: Any = expected  # the loader's own time is the script's, its check the runtime's
            if source is not None:
                batch = next_batch(source, step=self.step, max_steps=max_steps)
                with costs.timing("sampler"):
                    check_batch(issued, expected, step=self.step, rank=ctx.rank)
            healing = self._healing if self._healing is not None and self._healing.ready else None
            while True:
                started = healing.before_step(ctx.device, self._optimizer, self._scheduler, self._scaler) if healing else None
                stepped_before = self._optimizer_steps
                try:
                    yield batch
                except GeneratorExit:  # the loop left with `break`
                    if self._optimizer_steps != stepped_before:  # ... after training on this batch
                        self._count_step()
                    raise
                if healing is None or not healing.void:
                    self._end_step()
                    break
                step = self.step
                self._heal(started, healing.guard.error)
                if self.step != step:  # it took the state of this very step from a peer that completed it
                    break
                # else: the same batch again, on the healed group
        self._report_pending()

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

    def _end_step(self) -> None:
        self._count_step()
        costs = self.step_costs
        try:
            with costs.timing("vote"):
                verdict = self._vote.step_ended(self.step)
            self._act_on(verdict)
            with costs.timing("checkpoint"):  # the snapshot parts are moved out of it in `finish`
                self.checkpoints.maybe_save(self.step)
        except RuntimeError as error:  # a collective of the bookkeeping met the dead peer first
            if self._healing is None or not self._healing.ready:
                raise
            why = first_line(error)
        else:
            why = None
        if why is not None:  # healed out of the `except` block (see `_catch_up`)
            self._heal(None, why)
        with costs.timing("watchdog"):
            self._faults.at("after_step", self.step)
            self.watchdog.beat(self.step)

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

    def _heal(self, started: Any, why: str | None) -> None:
        """A peer died: form the next group in this process and take the newest state (elastic.healing).
        `started`: the void step's `before_step` (None when the step itself completed)."""
        ctx, healing = self._context, self._healing
        assert healing is not None
        began = time.perf_counter()
        if started is not None:
            healing.undo(started, ctx.device, self._optimizer, self._scheduler, self._scaler)
            self._loss = None
        logger.warning("rank %d: step %d %s (%s); healing in place", ctx.rank, self.step + 1,
                       "is void" if started is not None else "ended, its bookkeeping failed", why)
        with self.watchdog.paused():
            self._regroup()
            self.step = self._catch_up(self.step, replacement=False)
        seconds = time.perf_counter() - began
        self.events.emit("heal", step=self.step, world_size=ctx.world_size, generation=healing.generation,
                         seconds=seconds)
        if ctx.is_main:
            logger.info("healed in place (heal %d) in %.2f s: training on from step %d", healing.generation, seconds,
                        self.step)

    def _regroup(self) -> None:
        """Form the next heal's group, and build on it what met on the broken one."""
        healing = self._healing
        assert healing is not None
        earlier = self.checkpoints
        earlier.close(wait=0.0)  # its saves in flight met on the broken group
        # A vote in flight holds the broken group's connections open: a peer waiting in it would
        # wait its whole timeout instead of failing when this worker leaves (regroup.leave).
        self._vote = StepVote(self._context, self._ballot, grace=self.config.term_grace)
        healing.regroup(self._context)
        self.checkpoints = self._new_checkpoint_manager()
        self.checkpoints.take_over(earlier)

    def _catch_up(self, completed: int, *, replacement: bool) -> int:
        """Every member of the new group takes the newest state (from the lowest rank that has it);
        the step to go on from. A member that dies meanwhile breaks the group: the heal starts over
        with the next generation, at most `_CATCH_UP_ATTEMPTS` times."""
        healing = self._healing
        assert healing is not None
        for attempt in range(1, _CATCH_UP_ATTEMPTS + 1):
            try:
                agreed = healing.agree(completed)
                if agreed.most < 0:  # every member is a replacement: nobody holds the state
                    raise RegroupError(f"heal {healing.generation}: no member holds any state (every worker was "
                                       "replaced); a new round restores it")
                return self.checkpoints.restore_live(
                    source=agreed.source, step=agreed.most, take=replacement or completed < agreed.most,
                    replacement=replacement,
                )
            except (RuntimeError, GroupBroken) as error:
                why = first_line(error)
            # Out of the `except` block: its traceback holds the broken group (a frame of the failed
            # collective), whose sockets must close for the members still waiting in it to fail now.
            if attempt == _CATCH_UP_ATTEMPTS:
                raise RegroupError(f"heal {healing.generation} broke {attempt} times: {why}")
            logger.warning("rank %d: heal %d broke (%s); starting over", self.rank, healing.generation, why)
            self._regroup()
        raise AssertionError("unreachable")

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

    def _commit_and_stop(self, *, requeue: bool = False) -> NoReturn:
        """Commit this step on every rank (a storage failure raises here: no requeue follows), then leave;
        after the Slurm requeue signal, rank 0 of a job without an agent requeues it."""
        with self.watchdog.paused():  # a slow filesystem is not a hang
            self.checkpoints.save(self.step, reason="preemption")
            self.checkpoints.flush()
        saved = f"checkpoint committed in {self.checkpoints.store.root}" if self.checkpoints.enabled else None
        said = f"after step {self.step}; {saved or 'no --ckpt-dir, nothing saved'}"
        if requeue:
            said += after_preemption_commit(os.environ, rank=self.rank, step=self.step, said=said,
                                            job_id=self._context.slurm_job_id, committed=self.checkpoints.enabled)
        raise Preempted(f"stopped by {'the Slurm requeue signal' if requeue else 'SIGTERM'} {said}")

    def due(self, every: int) -> bool:
        """Whether the step just done by this run is a multiple of `every` (0: never)."""
        return every > 0 and self.step > self._first_step and self.step % every == 0

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Work between steps that is not a step (evaluation, sampling): the watchdog does not count it."""
        self._report_pending()
        with self.watchdog.paused(), self._preemption.hold():
            yield
        verdict = self._vote.fresh()
        self.checkpoints.agree_snapshot_interval(verdict.snapshot_every, self.step)
        if verdict.preempted:  # SIGTERM arrived meanwhile: commit this step, then leave
            self._preemption.at_boundary()
            self._commit_and_stop(requeue=verdict.requeue)

    def event(self, kind: str, **fields: Any) -> None:
        """Append an event (e.g. "eval") at the current step to the event log (rank 0)."""
        self.events.emit(kind, step=self.step, world_size=self.world_size, **fields)

    def print(self, message: str) -> None:
        """A line on rank 0's console that does not tear the progress bar."""
        if self._report is not None and self._report.progress is not None:
            self._report.progress.write(message)
        elif self.is_main:
            logger.info("%s", message)

    # -- the end --------------------------------------------------------------------

    def finish(self, **end_fields: Any) -> dict[str, Any]:
        """Commit the final checkpoint, check every rank holds the same parameters, log "end".

        A collective; called by leaving the `with` block if not before. Returns
        a summary: rank, step, loss (the last read), steps_per_s (of this process's loop).
        """
        ctx = self._context
        if self._finished:
            raise RuntimeError("Run.finish() was already called")
        self._finished = True
        self._report_pending()
        self._vote.settle()  # the last step's vote: read it (the final save follows whatever it says)
        self.watchdog.close()  # what follows is not a training step
        with self._preemption.hold():  # a SIGTERM now waits for the final checkpoint
            self.checkpoints.save(self.step, reason="final")
            self.checkpoints.flush()
        digests = gather_digests(ctx, parameter_digest(self.model))
        self.events.emit(
            "end", step=self.step, world_size=ctx.world_size, loss=self.last_loss, param_digests=digests, **end_fields
        )
        if self._report is not None:
            self._report.close()
        if len(set(digests)) != 1:
            raise ElasticError(f"ranks ended with different parameters (digests {digests}); the replicas diverged")
        steps = self.step - self._first_step
        seconds = self._loop_seconds
        for phase, spent in self.checkpoints.loop_seconds().items():  # the snapshot's parts of "checkpoint"
            self.step_costs.add(phase, spent)
        return {
            "rank": ctx.rank, "step": self.step, "loss": self.last_loss,
            "steps_per_s": steps / seconds if seconds > 0 else math.inf, "step_costs": self.step_costs.per_step(),
        }
