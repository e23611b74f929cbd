"""`elastic.Run`'s heals in place: its workers survive a peer's death in their own processes.

Under torchrevive-run with TORCHREVIVE_SURVIVORS=keep (elastic.launcher.in_place
is the agent's half, elastic.regroup the pieces), a worker's death stops no
other worker:

- A survivor's gradient all-reduce fails and its step is void (`StepGuard`):
  the optimizer step did nothing, and `undo` puts back what else the step
  changed (the scheduler's and the grad scaler's state, every RNG state),
  captured by `before_step`. `regroup` then leaves the broken group, waits for
  the agent's heal and forms the group of the next generation at the same rank
  and world size, with a fresh DDP reducer. The Run builds its checkpoint
  manager and step vote again on the new group, every member takes the newest
  state (`CheckpointManager.restore_live`), and the void step's batch is
  trained again: nothing was redone, no sample skipped, no checkpoint read.
- The replacement joins the group of its generation in `Run.__enter__`,
  builds its DDP without DDP's first broadcast (`init_sync=False`) and, in
  `Run.start`, takes the state from a survivor instead of restoring.

Invariants:
- A worker heals only with a model built by `run.ddp()` on gloo; else it never
  counts itself a healer (`arm` says why, once), and at a failure its agent
  takes a new round: every worker stops and restores, as without the setting.
- `arm` (in `Run.start`) comes before the first step: a worker that fails
  earlier was never counted, and its failure takes a new round too.
- A heal that cannot form is a `RegroupError` (one line, exit status 76); the
  agent then takes a new round.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic import heal_env, regroup
from elastic.errors import first_line
from elastic.rng import get_rng_state, set_rng_state
from elastic.runtime import WorkerContext

logger = logging.getLogger(__name__)

HEAL_BEGIN_TIMEOUT = timedelta(seconds=30)
"""A failed worker's agent starts the heal within its monitor interval; when none has after this
(plus the time a stopped worker is given), its node is gone: the worker exits with status 76 and
the remaining agents take a new round."""


@dataclass(frozen=True)
class StepStart:
    """What a step changes besides the parameters and the optimizer state, as of its start."""

    settings: list[dict[str, Any]]
    """The optimizer's hyperparameters per group: a scheduler's step changes the learning rate there."""
    scheduler: dict[str, Any] | None
    scaler: dict[str, Any] | None
    rng: dict[str, Any]


class Healing:
    """One worker's heals (see the module docstring)."""

    def __init__(self, point: regroup.HealPoint, *, timeout: timedelta, frozen_after: float = 0.0) -> None:
        self.point = point
        self.generation = point.generation
        """The heal whose group this worker is in (0: the round's first group)."""
        self.guard = regroup.StepGuard()
        self.ready = False
        """Armed: this worker counted itself a healer, and a failed step is void, not an exception."""
        self.heals = 0
        self._timeout = timeout
        self.begin_timeout = min(timeout, HEAL_BEGIN_TIMEOUT + timedelta(seconds=frozen_after))
        """How long a survivor waits for an agent to start the heal: a lost node's agent never does."""
        self._model: DistributedDataParallel | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], *, timeout: timedelta) -> Healing | None:
        """The worker's heals when its agent gave it a heal point; None otherwise."""
        point = regroup.heal_point(environ, timeout=timeout)
        if point is None:
            return None
        raw = environ.get(heal_env.FROZEN_AFTER_ENV, "")
        try:  # the agent checked it; a stopped worker's heal begins this much later
            frozen_after = min(max(float(raw), 0.0), 86400.0) if raw else heal_env.DEFAULT_FROZEN_AFTER
        except ValueError:
            frozen_after = heal_env.DEFAULT_FROZEN_AFTER
        return cls(point, timeout=timeout, frozen_after=frozen_after)

    @property
    def replacement(self) -> bool:
        """Started by a heal: its state comes from a survivor."""
        return self.generation > 0

    def group_store(self) -> dist.Store:
        """Where this worker's first process group meets."""
        return regroup.group_store(self.point.store, self.generation)

    def attach(self, model: torch.nn.Module) -> None:
        """Reduce the gradients of `model` (run.ddp's) through the step guard."""
        if isinstance(model, DistributedDataParallel):
            self.guard.attach(model)
            self._model = model

    def arm(self, ctx: WorkerContext, optimizer: torch.optim.Optimizer) -> bool:
        """Guard `optimizer` and count this worker a healer, when it can heal (else one line, rank 0)."""
        why = None
        if self._model is None:
            why = "the model is not a DDP built by run.ddp()"
        elif ctx.backend != "gloo":
            why = f"heals in place run on gloo, and this job's group is {ctx.backend}"
        if why is not None:
            if ctx.is_main:
                logger.warning("TORCHREVIVE_SURVIVORS=keep: %s; a failure restarts every worker", why)
            return False
        self.guard.guard(optimizer)
        try:
            regroup.count_healer(self.point.store, rank=ctx.rank, generation=self.generation)
        except RuntimeError as error:
            raise regroup.RegroupError(f"the rendezvous store failed: {first_line(error)}") from None
        self.ready = True
        return True

    @property
    def void(self) -> bool:
        """The step just trained failed on this rank (its gradient all-reduce did)."""
        return self.ready and self.guard.void

    def before_step(
        self, device: torch.device, optimizer: torch.optim.Optimizer, scheduler: Any = None, scaler: Any = None
    ) -> StepStart:
        """What `undo` puts back if the step turns out void."""
        return StepStart(
            settings=[{k: _copy(v) for k, v in group.items() if k != "params"} for group in optimizer.param_groups],
            scheduler=scheduler.state_dict() if scheduler is not None else None,
            scaler=scaler.state_dict() if scaler is not None else None,
            rng=get_rng_state(device),
        )

    def undo(
        self, start: StepStart, device: torch.device, optimizer: torch.optim.Optimizer, scheduler: Any = None,
        scaler: Any = None,
    ) -> None:
        """A void step: the optimizer's hyperparameters, the scheduler, the scaler and the RNG as they
        were when it began."""
        for group, settings in zip(optimizer.param_groups, start.settings):
            group.update(settings)
        if scheduler is not None and start.scheduler is not None:
            scheduler.load_state_dict(start.scheduler)
        if scaler is not None and start.scaler is not None:
            scaler.load_state_dict(start.scaler)
        set_rng_state(start.rng, device)

    def regroup(self, ctx: WorkerContext) -> None:
        """Leave the broken group, wait for the agent's heal, join the next generation's group
        and give DDP a fresh reducer on it (`RegroupError` when the heal does not form)."""
        regroup.leave(self._model)
        self.generation = regroup.next_generation(self.point, after=self.generation, timeout=self.begin_timeout)
        regroup.rejoin(
            self.point.store, generation=self.generation, rank=ctx.rank, world_size=ctx.world_size,
            backend="gloo", timeout=self._timeout,
        )
        assert self._model is not None  # armed
        regroup.rebind(self._model, self.guard)
        self.guard.clear()
        self.heals += 1

    def agree(self, completed: int) -> regroup.Agreement:
        """Every member's steps (a replacement gives -1: it completed none of its own)."""
        return regroup.agree(completed)


def _copy(value: Any) -> Any:
    """A hyperparameter as of now (a tensor learning rate is changed in place by schedulers)."""
    return value.clone() if isinstance(value, torch.Tensor) else value
