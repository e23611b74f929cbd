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
- A step's bookkeeping runs when the loop asks for the next batch, after the
  body's `optimizer.step()` and `scheduler.step()` (elastic._worker.run.loop, which
  holds `batches`, says what it does and in which order).
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
- With TORCHREVIVE_SURVIVORS=keep or train-on under torchrevive-run, a peer's
  death stops no other worker: the group changes in place (elastic._worker.survivors.plugin).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from elastic._shared.common.cli import configure_logging
from elastic._shared.common.errors import ElasticError, Preempted
from elastic._shared.protocol import fault_hook
from elastic._shared.slurm.requeue import (
    after_preemption_commit,
    note_commit,
    preemption_settings,
)
from elastic._worker.checkpoint import CheckpointManager
from elastic._worker.checkpoint.training_state import Stateful
from elastic._worker.config import RunConfig
from elastic._worker.control.preemption import PreemptionHandler
from elastic._worker.control.step_vote import StepVote
from elastic._worker.control.watchdog import NoWatchdog, Watchdog, watchdog
from elastic._worker.data.feed import StepBatchSampler, StepSampler
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.observe.events import EventLog
from elastic._worker.observe.metrics import start_metrics
from elastic._worker.observe.replicas import gather_digests, parameter_digest
from elastic._worker.observe.step_costs import StepCosts
from elastic._worker.observe.step_report import StepReport
from elastic._worker.run.loop import StepLoop
from elastic._worker.runtime import parallel
from elastic._worker.runtime.context import (
    WorkerContext,
    adopt_worker,
    barrier,
    init_worker,
    shutdown_worker,
)
from elastic._worker.runtime.parallel import unwrap
from elastic._worker.runtime.rng import seed_all
from elastic._worker.survivors.healing import Healing, StepStart
from elastic._worker.survivors.plugin import Survivors
from elastic._worker.survivors.regroup import RegroupError
from elastic._worker.survivors.views import joiners_waiting

logger = logging.getLogger(__name__)


class Run(StepLoop):
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
        self.due_after = 0
        """`due(n)` is true only past this step: not at the step a restart resumed from (evaluated before
        the failure), nor again at the step of a void step trained again; a worker joining a group at a
        step's bookkeeping counts from the step before, as the members that go on to that step's `due`."""
        self._leaving_failed = False
        self.step_costs = StepCosts()
        """Seconds per phase of the runtime's per-step work (elastic._worker.observe.step_costs)."""
        self._report: StepReport | None = None
        self._healing: Healing | None = None
        self._survivors: Survivors | None = None
        """Set when this worker's group changes in place after a failure (TORCHREVIVE_SURVIVORS)."""
        self.checkpoints: CheckpointManager | None = None

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
            # Under torchrevive-run with TORCHREVIVE_SURVIVORS=keep or train-on: heals in place (elastic._worker.survivors.healing).
            self._healing = Healing.from_environ(os.environ, timeout=timeout, heal_wait=timedelta(seconds=cfg.heal_wait))
            first_group = self._healing.first_group() if self._healing is not None else {}
            self.ctx = init_worker(cfg.device, timeout=timeout, **first_group)
            self._owns_group = self.ctx.distributed
        try:
            seed_all(cfg.seed, self.ctx.device)  # the model built next is identical on every rank
            joiner = self._healing is not None and self._healing.joiner  # rank 0 of a group of its own
            self.events = self._stack.enter_context(
                EventLog(cfg.events if self.ctx.is_main and not joiner else None, restart=self.ctx.restart_count)
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
        self._optimizer, self._scheduler, self._scaler, self._extra = optimizer, scheduler, scaler, extra
        # Leaving on an error, peers may be dead: a save in flight (its writers meet in
        # collectives) gets a few seconds, not --ckpt-timeout.
        self._stack.callback(lambda: self.checkpoints is not None and self.checkpoints.close(  # a clean end lets go
            wait=5.0 if self._leaving_failed else None, ended=not self._leaving_failed))
        healing = self._healing
        # ELASTIC_FAULT, for the chaos suite: a fault names the rank a worker started as.
        self._faults = fault_hook.for_worker(healing.point.rank if healing else ctx.rank, ctx.restart_count)
        if healing is not None and healing.arm(ctx, optimizer):
            self._survivors = Survivors(self, healing)
            if self._faults is not fault_hook.NO_FAULTS:  # the chaos suite's kill inside a gradient all-reduce
                healing.guard.before_reduce = lambda: self._faults.at("during_all_reduce", self.step + 1)
        elif healing is not None and healing.joiner:
            raise RegroupError("a replacement that cannot heal in place has no group to join")
        joined = healing is not None and healing.joiner
        if joined:  # train-on: wait until the group admits this worker, then take a member's state
            self._survivors.join()  # type: ignore[union-attr]
            ctx = self._context
        self._stack.enter_context(  # before restore, so a scrape sees the restore too
            start_metrics(
                ctx, self.events, port=cfg.metrics_port, host=cfg.metrics_host, samples_per_step=batch_size,
                tokens_per_sample=tokens_per_sample, watchdog=self.watchdog,
            )
        )
        self._optimizer_steps = 0  # tells a `break` after optimizer.step() from one before it
        hook = optimizer.register_step_post_hook(lambda *_: self._count_optimizer_step())
        self._stack.callback(hook.remove)
        self._preemption = PreemptionHandler(ctx, grace=cfg.term_grace, **preemption_settings(os.environ))
        self._stack.callback(self._preemption.uninstall)
        if not joined:
            seed_all(cfg.seed + ctx.rank, ctx.device)  # each rank its own stream (dropout); restore overrides it
            self.rebuild_on_group(ctx, None)
            if self._survivors is not None and healing is not None and healing.replacement:
                self.step = self._survivors.catch_up_replacement()  # keep: a survivor's state, from its memory
            else:
                self.step = self.checkpoints.restore()
        self._first_step = self.step
        if not joined:
            self.due_after = self.step  # (a joiner's was set when it joined: elastic._worker.survivors.plugin)
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

    # -- the group changed in place (elastic._worker.survivors.plugin) ---------------------------------------

    def rebuild_on_group(self, ctx: WorkerContext, earlier: CheckpointManager | None) -> None:
        """The default group is new (or the first): build the step vote and the checkpoint manager
        on it, taking over from `earlier`; its rank 0 writes the event log."""
        self.ctx = ctx
        healing = self._healing
        joiners = (lambda: joiners_waiting(healing.point.store)) if healing and healing.train_on and ctx.is_main else None
        self._vote = StepVote(ctx, self._ballot, grace=self.config.term_grace, joiners=joiners)
        self.checkpoints = CheckpointManager(
            ctx, self.config, model=self.model, optimizer=self._optimizer, sampler=self.sampler,
            scheduler=self._scheduler, scaler=self._scaler, extra=self._extra, events=self.events, faults=self._faults,
        )
        if earlier is not None:
            self.checkpoints.take_over(earlier)
        if healing is not None and healing.train_on:
            self.events.write_to(self.config.events if ctx.is_main else None)
        if self._report is not None:
            per_step = self.sampler.batch_size * ctx.world_size * (self._tokens_per_sample or 1)
            self._report.resize(ctx.world_size, per_step)

    def drop_group_parts(self) -> None:
        """Before leaving the group: saves in flight met on it (abandoned), and a vote in flight holds
        its connections open (a peer waiting in it would wait its whole timeout, not fail at once)."""
        if self.checkpoints is not None:
            self.checkpoints.close(wait=0.0)
        self._vote = StepVote(self._context, self._ballot, grace=self.config.term_grace)

    def stopping(self) -> bool:
        """SIGTERM reached this worker (elastic._worker.survivors.plugin: it then leaves a broken group, never joins the next)."""
        return self._preemption.signalled

    def undo_step(self, started: StepStart) -> None:
        """A void step: put back what it changed besides the parameters (elastic._worker.survivors.healing.Healing.undo)."""
        assert self._healing is not None
        self._healing.undo(started, self._context.device, self._optimizer, self._scheduler, self._scaler)
        self._loss = None

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

    def _commit_and_stop(self, *, requeue: bool = False) -> NoReturn:
        """Commit this step on every rank (a storage failure raises here: no requeue follows), then leave;
        after the Slurm requeue signal, rank 0 of a job without an agent requeues it."""
        with self.watchdog.paused():  # a slow filesystem is not a hang
            self.checkpoints.save(self.step, reason="preemption")
            self.checkpoints.flush()
        saved = f"checkpoint committed in {self.checkpoints.store.root}" if self.checkpoints.enabled else None
        said = f"after step {self.step}; {saved or 'no --ckpt-dir, nothing saved'}"
        if self.checkpoints.enabled:
            # Under an agent the commit is noted whatever stopped this worker: the agent may have taken
            # Slurm's requeue signal first and stopped its workers with SIGTERM before Slurm's own
            # requeue signal reached them. The agent requeues only when it had that signal.
            note_commit(os.environ, self.rank, self.step)
        if requeue:
            said += after_preemption_commit(rank=self.rank, said=said, job_id=self._context.slurm_job_id,
                                            committed=self.checkpoints.enabled)
        raise Preempted(f"stopped by {'the Slurm requeue signal' if requeue else 'SIGTERM'} {said}")

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
        if self._healing is not None and self._healing.train_on and ctx.is_main:
            self._healing.job_ended()  # workers still waiting to join leave
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
