"""`elastic.Run`: the one object a training script talks to.

    with elastic.Run.from_args(args) as run:                      # every rank: joins the job
        model = run.ddp(Net().to(run.device))
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        run.start(model=model, optimizer=optimizer, data=dataset, batch_size=args.batch_size)
        loader = DataLoader(dataset, batch_sampler=run.batch_sampler(), num_workers=2)
        for epoch in run.epochs(args.epochs):                     # or run.batches(loader, max_steps=N)
            for x, y in run.batches(loader):
                loss = loss_fn(model(x.to(run.device)), y.to(run.device))
                optimizer.zero_grad(); loss.backward(); optimizer.step(); run.log(loss)
            evaluate(model)                                       # the epoch's end: as in run.pause()
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
  body's `optimizer.step()` and `scheduler.step()` (elastic._worker.run.loop, the
  part that runs `batches`, says what it does and in which order).
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
  the preemption vote taken then commits the step (a collective). A peer's
  death there, where the run heals in place, heals at the step instead.
- With `--survivors keep|train-on` under torchrevive-run, a peer's death stops
  no other worker: the group changes in place (elastic._worker.survivors.plugin,
  which the run meets only through its hooks and a private adapter).

A `Run` is composed of parts: the step loop (`StepLoop`, loop.py), the parts
that live on one process group (`GroupParts`, group.py: the step vote and the
checkpoint manager, built again when the group changes), and the optional
survivors plug-in.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from types import TracebackType
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from elastic._shared.common.cli import configure_logging
from elastic._shared.common.errors import CheckpointStorageError, ElasticError
from elastic._shared.protocol import fault_hook
from elastic._shared.slurm.requeue import preemption_settings
from elastic._worker.checkpoint import CheckpointManager
from elastic._worker.checkpoint.training_state import Stateful
from elastic._worker.config import RunConfig
from elastic._worker.control.preemption import PreemptionHandler
from elastic._worker.control.step_vote import Verdict
from elastic._worker.control.watchdog import NoWatchdog, Watchdog, watchdog
from elastic._worker.data.feed import StepBatchSampler, StepSampler
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.integrity.loop_part import Integrity
from elastic._worker.observe.events import EventLog
from elastic._worker.observe.metrics import start_metrics
from elastic._worker.observe.replicas import gather_digests, parameter_digest
from elastic._worker.observe.slow_ranks import SlowRanks
from elastic._worker.observe.step_costs import StepCosts
from elastic._worker.run.epochs import EpochLoop, epochs_done
from elastic._worker.run.group import GroupParts, TrainingState
from elastic._worker.run.loop import StepLoop
from elastic._worker.run.peer_loss import raise_if_peer_lost
from elastic._worker.run.script_exit import ScriptExit
from elastic._worker.run.stopping import commit_and_stop
from elastic._worker.run.survivors_host import SurvivorsHost
from elastic._worker.runtime import parallel
from elastic._worker.runtime.collectives import pause_collectives
from elastic._worker.runtime.context import WorkerContext, adopt_worker, init_worker, leave_group
from elastic._worker.runtime.parallel import unwrap
from elastic._worker.runtime.rng import isolated, seed_all
from elastic._worker.survivors.plugin import Survivors

logger = logging.getLogger(__name__)

Batch = TypeVar("Batch")


class Run:
    """A fault-tolerant training run of this worker; see the module docstring."""

    def __init__(self, config: RunConfig | None = None, **settings: Any) -> None:
        if config is not None and settings:
            raise TypeError("pass a RunConfig or keyword settings, not both")
        self.config = config if config is not None else RunConfig.of(**settings)
        self.ctx: WorkerContext | None = None
        self.step = 0
        """Steps completed by the whole job (restored ones included)."""
        self.step_costs = StepCosts()
        """Seconds per phase of the runtime's per-step work (elastic._worker.observe.step_costs)."""
        self._stack = ExitStack()
        self._owns_group = False
        self._started = self._finished = False
        self._first_step = 0
        self._leaving_failed = False
        self._loop = StepLoop(self)
        self._group: GroupParts | None = None
        """The step vote and checkpoint manager of the current process group (built in `start`)."""
        self._survivors: Survivors | None = None
        """The survivors plug-in, under torchrevive-run --survivors keep|train-on."""
        self._script_exit: ScriptExit | None = None
        self._epochs = EpochLoop(self.pause)  # `run.epochs`, and where `run.batches` stops

    @classmethod
    def from_args(cls, args: Any) -> Run:
        """The runtime's settings among argparse's namespace, a mapping or a dataclass (`RunConfig.from_args`)."""
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
            # Under torchrevive-run --survivors keep|train-on: heals in place (elastic._worker.survivors).
            self._survivors = Survivors.from_environ(
                os.environ, timeout=timeout, heal_wait=timedelta(seconds=cfg.heal_wait))
            first_group = self._survivors.first_group() if self._survivors is not None else {}
            self.ctx = init_worker(cfg.device, timeout=timeout, **first_group)
            self._owns_group = self.ctx.distributed
        try:
            seed_all(cfg.seed, self.ctx.device)  # the model built next is identical on every rank
            joiner = self._survivors is not None and self._survivors.joiner  # rank 0 of a group of its own
            self.events = self._stack.enter_context(
                EventLog(cfg.events if self.ctx.is_main and not joiner else None, restart=self.ctx.restart_count)
            )
            self.watchdog: Watchdog | NoWatchdog = watchdog(cfg.hang_timeout, distributed=self.ctx.distributed)  # armed by the first step
            self._stack.callback(self.watchdog.close)
        except BaseException:
            self._leave(failed=True)
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
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
        raise_if_peer_lost(exc, rank=self.rank, step=self.step, heals=self._survivors is not None)  # one line

    # -- a script written at module level, without a `with` block -----------------------------

    def open(self) -> Run:
        """Join the job as `with run:` would, for a script written at module level (no `with` block):

            run = elastic.Run.from_args(args).open()
            ...                                    # the script; `run.close()` at its end is optional

        The guarantees at exit are the `with` block's (elastic._worker.run.script_exit says how).
        """
        self.__enter__()
        self._script_exit = ScriptExit.install(self.__exit__)
        return self

    def close(self) -> None:
        """Leave as the end of a `with` block does (see `open`); a second call does nothing."""
        if self._script_exit is None or not self._script_exit.pending:
            return
        self._script_exit.uninstall()
        self.__exit__(None, None, None)

    def _leave(self, *, failed: bool) -> None:
        self._leaving_failed = failed
        try:
            self._stack.close()  # commits saves in flight, puts SIGTERM back, closes metrics and the log
        except BaseException:
            failed = True
            raise
        finally:
            if self._owns_group:
                self._owns_group = False
                leave_group(self._context, failed=failed)

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

    @property
    def checkpoints(self) -> CheckpointManager | None:
        """The state manager of the current process group (None before `start`)."""
        return self._group.checkpoints if self._group is not None else None

    def ddp(self, model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        """`model` under DistributedDataParallel in a job of several processes, as is alone."""
        if self._survivors is not None:
            self._survivors.prepare_ddp(kwargs)
        wrapped = parallel.ddp(self._context, model, **kwargs)
        if self._survivors is not None:
            self._survivors.attach(wrapped)
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
        self._integrity = Integrity(ctx, cfg, self.events)  # replica checks, numeric guard (elastic._worker.integrity)
        self._slow_ranks = self._stack.enter_context(SlowRanks(ctx, cfg, self.events, self.model, sampler=self.sampler, ddp=model))
        self._state = TrainingState(self.model, optimizer, self.sampler, scheduler, scaler, self._integrity.registered(extra))
        # Leaving on an error, peers may be dead: a save in flight (its writers meet in
        # collectives) gets a few seconds, not --ckpt-timeout.
        self._stack.callback(lambda: self.checkpoints is not None and self.checkpoints.close(  # a clean end lets go
            wait=5.0 if self._leaving_failed else None, ended=not self._leaving_failed))
        survivors = self._survivors
        # ELASTIC_FAULT, for the chaos suite: a fault names the rank a worker started as.
        self._faults = fault_hook.for_worker(survivors.fault_rank() if survivors else ctx.rank, ctx.restart_count)
        if survivors is not None:
            survivors.arm(SurvivorsHost(self), ctx, (optimizer, scheduler, scaler), self._faults)
        joined = survivors is not None and survivors.joiner
        if joined:  # train-on: wait until the group admits this worker, then take a member's state
            survivors.join()  # type: ignore[union-attr]
            ctx = self._context
        self._stack.enter_context(  # before restore, so a scrape sees the restore too
            start_metrics(
                ctx, self.events, port=cfg.metrics_port, host=cfg.metrics_host, samples_per_step=batch_size,
                tokens_per_sample=tokens_per_sample, watchdog=self.watchdog,
            )
        )
        hook = optimizer.register_step_post_hook(lambda *_: self._loop.count_optimizer_step())
        self._stack.callback(hook.remove)
        self._preemption = PreemptionHandler(ctx, grace=cfg.term_grace, **preemption_settings(os.environ))
        self._stack.callback(self._preemption.uninstall)
        if not joined:
            seed_all(cfg.seed + ctx.rank, ctx.device)  # each rank its own stream (dropout); restore overrides it
            self._rebuild_on_group(ctx, None)
            if survivors is not None and survivors.replaces_a_worker:
                self.step = survivors.catch_up_replacement()  # keep: a survivor's state, from its memory
            else:
                self.step = self._parts.checkpoints.restore()
            self._loop.due_after = self.step  # (a joiner's was set when it joined)
        self._integrity.attach(self._parts.checkpoints.state, optimizer, self._faults, self._stack, lambda: self._loop.loss)
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

    # -- the parts that live on one process group ---------------------------------------

    @property
    def _parts(self) -> GroupParts:
        assert self._group is not None, "built in Run.start"
        return self._group

    def _rebuild_on_group(self, ctx: WorkerContext, earlier: CheckpointManager | None) -> None:
        """The default group is new (or the first): build the step vote and the checkpoint manager
        on it, taking over from `earlier`."""
        self.ctx = ctx
        survivors = self._survivors
        self._group = GroupParts.build(
            ctx, self.config, self._state, ballot=self._ballot, events=self.events, faults=self._faults,
            joiners=survivors.joiners_waiting(ctx) if survivors is not None else None, earlier=earlier,
            slow_ranks=self._slow_ranks, integrity=self._integrity,
        )
        if survivors is not None:
            survivors.on_new_group(ctx, self.events, self.config.events)
        report = self._loop.report
        if report is not None:
            report.resize(ctx.world_size, self.sampler.batch_size * ctx.world_size * (self._tokens_per_sample or 1))

    def _ballot(self) -> tuple[bool, bool, bool, int]:
        stop, checkpoints = self._preemption, self._parts.checkpoints
        return stop.signalled, stop.requeue_signalled, checkpoints.must_stop, checkpoints.snapshot_proposal()

    @property
    def epoch(self) -> int:
        """The epoch the next step starts in."""
        return self._sampler_checked().epoch

    @property
    def epochs_done(self) -> float:
        """Passes over the data set so far, as a fraction."""
        return epochs_done(self._sampler_checked())

    def _sampler_checked(self) -> ElasticSampler:
        if not self._started:
            raise RuntimeError("call Run.start() first")
        return self.sampler

    # -- data and steps ---------------------------------------------------------------

    def batch_sampler(self) -> StepBatchSampler:
        """For `DataLoader(dataset, batch_sampler=...)`: this rank's share of each step, exactly once per epoch."""
        return StepBatchSampler(self._sampler_checked(), self.rank, self.world_size)

    def sampler_for_loader(self) -> StepSampler:
        """For `DataLoader(dataset, sampler=..., batch_size=B)` with B the batch size given to `start`."""
        return StepSampler(self._sampler_checked(), self.rank, self.world_size)

    def batches(self, loader: Iterable[Batch] | None = None, *, max_steps: int | None = None,
                max_epochs: int | None = None) -> Iterator[Batch]:
        """This rank's batch of each step until `max_steps` steps or `max_epochs` epochs are done (whichever
        first; inside `run.epochs`, also the epoch's end: elastic._worker.run.epochs).

        Without `loader`, the batch is this rank's sample indices (a tensor).
        The step's bookkeeping runs when the next batch is asked for (elastic._worker.run.loop);
        a `break` after the body's optimizer step counts that step as done, a `break`
        before it leaves the step untrained.
        """
        self._sampler_checked()
        return self._epochs.steps(self._loop.batches(loader, self._epochs.limit(max_steps, max_epochs)))

    def epochs(self, max_epochs: int) -> Iterator[int]:
        """`for epoch in run.epochs(N): for batch in run.batches(loader): ...` then end-of-epoch work (an
        evaluation): each epoch from the one the run resumes in; the end of each runs as a `pause()` block
        (random streams forked, the watchdog off). See elastic._worker.run.epochs."""
        return self._epochs.epochs(self._sampler_checked(), max_epochs)

    def log(self, loss: torch.Tensor | float) -> None:
        """The loss of the step being trained; read out one step later (no device sync now)."""
        self._loop.log(loss)

    @property
    def last_loss(self) -> float:
        """The newest loss read (one step late; nan before any)."""
        return self._loop.last_loss

    def due(self, every: int) -> bool:
        """Whether the step just done by this run is a multiple of `every` (0: never)."""
        return self._loop.due(every)

    def _act_on(self, verdict: Verdict) -> None:
        """What every rank does with the step vote's verdict, at the same step (the loop calls it)."""
        checkpoints = self._parts.checkpoints
        checkpoints.agree_snapshot_interval(verdict.snapshot_every, self.step)
        if verdict.preempted:  # SIGTERM on any rank: commit this step, then leave
            self._preemption.at_boundary()  # the checkpoint that follows may take its time
            self._loop.flush_report()
            commit_and_stop(self._parts.checkpoints, self.watchdog, self._context, self.step, requeue=verdict.requeue)
        if verdict.storage_failing:  # rank 0's saves keep failing: stop before more work is lost
            self._loop.flush_report()
            raise CheckpointStorageError(checkpoints.share_stop_reason())

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Work between steps that is not a step (evaluation, sampling): the watchdog does not count it, every
        random stream the checkpoint carries is forked for it (runtime/rng.py `isolated`): it never moves training's,
        and a peer's death in its collectives, where the run heals, heals at the step (runtime/collectives.py)."""
        self._loop.flush_report()
        survivors = self._survivors
        with pause_collectives(tolerant=survivors is not None and survivors.can_heal) as collectives:
            with self.watchdog.paused(), self._preemption.hold(), isolated(self.device):
                self._faults.at("during_pause", self.step)
                yield
            verdict = collectives.call(self._parts.vote.fresh)  # a SIGTERM meanwhile: commit this step, then leave
        if collectives.broken is not None and survivors is not None:
            if self._loop.before_update():  # else the update was made: the next collective heals, past this step
                survivors.void_step(collectives.broken)
        elif verdict is not None:
            self._act_on(verdict)

    def event(self, kind: str, **fields: Any) -> None:
        """Append an event (e.g. "eval") at the current step to the event log (rank 0)."""
        self.events.emit(kind, step=self.step, world_size=self.world_size, **fields)

    def print(self, message: str) -> None:
        """A line on rank 0's console that does not tear the progress bar."""
        report = self._loop.report
        if report is not None and report.progress is not None:
            report.progress.write(message)
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
        parts = self._parts
        self._loop.flush_report()
        parts.vote.settle()  # the last step's vote: read it (the final save follows whatever it says)
        self.watchdog.close()  # what follows is not a training step
        with self._preemption.hold():  # a SIGTERM now waits for the final checkpoint
            parts.checkpoints.save(self.step, reason="final")
            parts.checkpoints.flush()
        digests = gather_digests(ctx, parameter_digest(self.model))
        if self._survivors is not None:
            self._survivors.job_ended(ctx)  # workers still waiting to join leave
        self.events.emit(
            "end", step=self.step, world_size=ctx.world_size, loss=self.last_loss, param_digests=digests, **end_fields
        )
        if self._loop.report is not None:
            self._loop.report.close()
        if len(set(digests)) != 1:
            raise ElasticError(f"ranks ended with different parameters (digests {digests}); the replicas diverged")
        return self._loop.summary(ctx.rank, self._first_step, parts.checkpoints.loop_seconds())
