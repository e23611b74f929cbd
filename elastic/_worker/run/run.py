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

What is saved, at every `--ckpt-every` step, on SIGTERM and at the end: the model, the optimizer, the
scheduler and grad scaler if given, each `extra` object, the data position (the elastic sampler: how
many samples of which epoch the whole job consumed), the step, and every rank's RNG states. A restarted
worker, at the same or another world size, continues from the newest checkpoint that verifies: same
samples, same random numbers.

Invariants (the ordering rules a recipe used to keep by hand):
- Every rank makes the same calls in the same order: `start`, each step of `batches`, `pause` blocks,
  `finish` are collectives.
- Opening (`with`), `start` and leaving keep the order elastic._worker.run.opening states:
  the model is built identical on every rank, and a kill during restore loses nothing.
- A step's bookkeeping runs when the loop asks for the next batch, after the body's `optimizer.step()`
  and `scheduler.step()` (elastic._worker.run.loop says what it does and in which order).
- Saves block the loop only to copy the state; writing runs behind the next steps, and a save due while
  the previous one is still being written is skipped. `finish` and a preemption block until the
  checkpoint is committed (within `ckpt_timeout`, in slices that keep every collective short).
- A failed save is a warning, an event and a metric, and training goes on. After `ckpt_max_failures`
  in a row (the vote carries rank 0's verdict), or when the final or preemption save fails, every rank
  raises `CheckpointStorageError` (exit status 75) at the same step; the committed checkpoints are intact.
- `pause()` marks work that is not a training step (evaluation, sampling); what that means
  is elastic._worker.run.closing's, as is `finish`.
- With `--survivors keep|train-on` under torchrevive-run, a peer's death stops no other worker: the
  group changes in place (elastic._worker.survivors.plugin, met through its hooks and an adapter).

`Run` is the front door and holds no state of its own: it hands each call to the run's shared
state (`RunCore`, core.py), on which the step loop (loop.py), the parts that live on one process
group (group.py), the loop parts (parts.py: `Run(parts=[...])` adds one) and the survivors plug-in
work. None of them reaches into `Run`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, TypeVar

import torch

from elastic._worker.checkpoint import CheckpointManager
from elastic._worker.checkpoint.training_state import Stateful
from elastic._worker.config import RunConfig
from elastic._worker.control.watchdog import NoWatchdog, Watchdog
from elastic._worker.data.feed import StepBatchSampler, StepSampler
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.observe.events import EventLog
from elastic._worker.observe.step_costs import StepCosts
from elastic._worker.run import closing, opening
from elastic._worker.run.core import RunCore
from elastic._worker.run.epochs import EpochLoop, epochs_done
from elastic._worker.run.parts import LoopPart
from elastic._worker.run.peer_loss import raise_if_peer_lost
from elastic._worker.run.script_exit import ScriptExit
from elastic._worker.runtime import parallel
from elastic._worker.runtime.context import WorkerContext

Batch = TypeVar("Batch")


class Run:
    """A fault-tolerant training run of this worker; see the module docstring."""

    def __init__(self, config: RunConfig | None = None, *, parts: Sequence[LoopPart] = (), **settings: Any) -> None:
        """`parts`: loop parts of the script's own (elastic._worker.run.parts), called after the built-in ones."""
        if config is not None and settings:
            raise TypeError("pass a RunConfig or keyword settings, not both")
        self.core = RunCore(config if config is not None else RunConfig.of(**settings), list(parts))
        """The run's shared state, which its parts work on (elastic._worker.run.core)."""
        self._loop = self.core.loop
        self._script_exit: ScriptExit | None = None
        self._epochs = EpochLoop(self.pause)  # `run.epochs`, and where `run.batches` stops

    @classmethod
    def from_args(cls, args: Any) -> Run:
        """The runtime's settings among argparse's namespace, a mapping or a dataclass (`RunConfig.from_args`)."""
        return cls(RunConfig.from_args(args))

    # -- opening and leaving ---------------------------------------------------------

    def __enter__(self) -> Run:
        opening.join(self.core)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        core = self.core
        # Preempted and a storage stop are raised on every rank at the same step: they leave together.
        failed = exc_type is not None and not getattr(exc_type, "raised_everywhere", False)
        try:
            if exc_type is None and core.started and not core.finished:
                self.finish()
        except BaseException:
            failed = True
            raise
        finally:
            opening.leave(core, failed=failed)
        raise_if_peer_lost(exc, rank=self.rank, step=core.step, heals=core.survivors is not None)  # one line

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

    # -- who and where -------------------------------------------------------------

    @property
    def config(self) -> RunConfig:
        return self.core.config

    @property
    def ctx(self) -> WorkerContext | None:
        """This worker's place in the current process group (None outside the `with` block)."""
        return self.core.ctx

    @property
    def device(self) -> torch.device:
        return self.core.context.device

    @property
    def rank(self) -> int:
        return self.core.context.rank

    @property
    def world_size(self) -> int:
        return self.core.context.world_size

    @property
    def is_main(self) -> bool:
        return self.core.context.is_main

    @property
    def distributed(self) -> bool:
        return self.core.context.distributed

    @property
    def step(self) -> int:
        """Steps completed by the whole job (restored ones included)."""
        return self.core.step

    @property
    def step_costs(self) -> StepCosts:
        """Seconds per phase of the runtime's per-step work (elastic._worker.observe.step_costs)."""
        return self.core.step_costs

    @property
    def events(self) -> EventLog:
        return self.core.events

    @property
    def watchdog(self) -> Watchdog | NoWatchdog:
        return self.core.watchdog

    @property
    def model(self) -> torch.nn.Module:
        """The model given to `start`, unwrapped."""
        if self.core.model is None:
            raise RuntimeError("call Run.start() first")
        return self.core.model

    @property
    def sampler(self) -> ElasticSampler:
        """The elastic sampler `start` made (the data position the checkpoint carries)."""
        return self.core.sampler_checked()

    @property
    def checkpoints(self) -> CheckpointManager | None:
        """The state manager of the current process group (None before `start`)."""
        return self.core.checkpoints

    def ddp(self, model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        """`model` under DistributedDataParallel in a job of several processes, as is alone."""
        return opening.wrap_ddp(self.core, model, kwargs)

    def fsdp(self, model: torch.nn.Module, *, blocks: Iterable[torch.nn.Module] = (),
             mixed_precision: bool | None = None) -> torch.nn.Module:
        """`model` sharded with FSDP2 over every rank (see `parallel.fsdp`). Build the optimizer after this call."""
        return parallel.fsdp(self.core.context, model, blocks=blocks, mixed_precision=mixed_precision)

    # -- state ----------------------------------------------------------------------

    def start(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: Any, batch_size: int,
              scheduler: torch.optim.lr_scheduler.LRScheduler | None = None, scaler: torch.amp.GradScaler | None = None,
              extra: Mapping[str, Stateful] | None = None, tokens_per_sample: int = 0) -> int:
        """Register the state and restore the newest checkpoint; returns the step to continue from.

        `data`: the training set (or its length); `batch_size`: samples per rank
        per step. `tokens_per_sample` (sequence models) makes throughput count tokens.
        A collective. Raises `CheckpointMismatchError` (one line, nothing
        changed) for a checkpoint of another model, optimizer, data set or state.
        """
        return opening.start(self.core, model=model, optimizer=optimizer, data=data, batch_size=batch_size,
                             scheduler=scheduler, scaler=scaler, extra=extra, tokens_per_sample=tokens_per_sample)

    @property
    def epoch(self) -> int:
        """The epoch the next step starts in."""
        return self.core.sampler_checked().epoch

    @property
    def epochs_done(self) -> float:
        """Passes over the data set so far, as a fraction."""
        return epochs_done(self.core.sampler_checked())

    # -- data and steps ---------------------------------------------------------------

    def batch_sampler(self) -> StepBatchSampler:
        """For `DataLoader(dataset, batch_sampler=...)`: this rank's share of each step, exactly once per epoch."""
        return StepBatchSampler(self.core.sampler_checked(), self.rank, self.world_size)

    def sampler_for_loader(self) -> StepSampler:
        """For `DataLoader(dataset, sampler=..., batch_size=B)` with B the batch size given to `start`."""
        return StepSampler(self.core.sampler_checked(), self.rank, self.world_size)

    def batches(self, loader: Iterable[Batch] | None = None, *, max_steps: int | None = None,
                max_epochs: int | None = None) -> Iterator[Batch]:
        """This rank's batch of each step until `max_steps` steps or `max_epochs` epochs are done (whichever
        first; inside `run.epochs`, also the epoch's end: elastic._worker.run.epochs), or until a loop part
        stops the loop (on every rank at the same step).

        Without `loader`, the batch is this rank's sample indices (a tensor).
        The step's bookkeeping runs when the next batch is asked for (elastic._worker.run.loop);
        a `break` after the body's optimizer step counts that step as done, a `break`
        before it leaves the step untrained.
        """
        self.core.sampler_checked()
        return self._epochs.steps(self._loop.batches(loader, self._epochs.limit(max_steps, max_epochs)))

    def epochs(self, max_epochs: int) -> Iterator[int]:
        """`for epoch in run.epochs(N): for batch in run.batches(loader): ...` then end-of-epoch work (an
        evaluation): each epoch from the one the run resumes in; the end of each runs as a `pause()` block
        (random streams forked, the watchdog off). See elastic._worker.run.epochs."""
        return self._epochs.epochs(self.core.sampler_checked(), max_epochs)

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

    def pause(self) -> AbstractContextManager[None]:
        """Work between steps that is not a step (evaluation, sampling): the watchdog does not count it, every
        random stream the checkpoint carries is forked for it (runtime/rng.py `isolated`): it never moves training's,
        and a peer's death in its collectives, where the run heals, heals at the step (runtime/collectives.py)."""
        return closing.pause(self.core)

    def event(self, kind: str, **fields: Any) -> None:
        """Append an event (e.g. "eval") at the current step to the event log (rank 0)."""
        self.core.events.emit(kind, step=self.core.step, world_size=self.world_size, **fields)

    def print(self, message: str) -> None:
        """A line on rank 0's console that does not tear the progress bar."""
        self._loop.print(message, main=self.is_main)

    # -- the end --------------------------------------------------------------------

    def finish(self, **end_fields: Any) -> dict[str, Any]:
        """Commit the final checkpoint, check every rank holds the same parameters, log "end".

        A collective; called by leaving the `with` block if not before. Returns
        a summary: rank, step, loss (the last read), steps_per_s (of this process's loop).
        """
        return closing.finish(self.core, **end_fields)
