"""`elastic.Run`'s heals in place: its workers survive a peer's death in their own processes.

Under torchrevive-run with TORCHREVIVE_SURVIVORS=keep (elastic._agent.launcher.in_place
is the agent's half, elastic._worker.survivors.regroup the pieces), a worker's death stops no
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

With TORCHREVIVE_SURVIVORS=train-on the survivors do not wait for the
replacement: the groups are elastic._worker.survivors.views' (a group per view, ranks in the
view's order). After a failure a survivor leaves the broken group, arrives at
the next view (`shrink`) and forms it with whoever else arrived; a replacement,
or a survivor that came too late, holds a group of its own until a grow admits
it (`wait_to_join`), and then forms the grown view with the others (`enter`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic._shared.common.errors import first_line
from elastic._shared.protocol import heal_env
from elastic._worker.config import RunConfig
from elastic._worker.runtime.context import WorkerContext
from elastic._worker.runtime.rng import get_rng_state, set_rng_state
from elastic._worker.survivors import catch_up, ddp_rebind, joiners, regroup, views
from elastic._worker.survivors.groups import PROCESS, Groups
from elastic._worker.survivors.lifecycle import Phase
from elastic._worker.survivors.views import View

logger = logging.getLogger(__name__)

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

    def __init__(
        self, point: regroup.HealPoint, *, timeout: timedelta, frozen_after: float = 0.0,
        heal_wait: timedelta = timedelta(seconds=RunConfig.heal_wait), groups: Groups = PROCESS,
    ) -> None:
        """`groups`: where this worker's groups live (groups.py: the process's default group; a test's
        ranks as threads each hold their own)."""
        self.point = point
        self.groups = groups
        self.generation = point.generation
        """The heal whose group this worker is in (0: the round's first group)."""
        self.guard = ddp_rebind.StepGuard()
        self.ready = False
        """Armed: this worker counted itself a healer, and a failed step is void, not an exception."""
        self.heals = 0
        self._timeout = timeout
        self.begin_timeout = min(timeout, heal_wait + timedelta(seconds=frozen_after))
        """How long a survivor waits for an agent to start the heal (`RunConfig.heal_wait`): a failed
        worker's agent starts it within its monitor interval, a lost node's agent never does."""
        self._model: DistributedDataParallel | None = None
        self.view = views.first_view(point.world_size)
        self._arrived = False
        """With `train-on`: the view whose group this worker is in, or last left (a replacement: the round's start)."""
        self.fault: Callable[[str], None] = lambda point: None
        """A fault point at the step being trained (elastic._shared.protocol.fault_hook's during_heal)."""

    @classmethod
    def from_environ(
        cls, environ: Mapping[str, str], *, timeout: timedelta, heal_wait: timedelta = timedelta(seconds=RunConfig.heal_wait)
    ) -> Healing | None:
        """The worker's heals when its agent gave it a heal point; None otherwise."""
        point = regroup.heal_point(environ, timeout=timeout)
        if point is None:
            return None
        raw = environ.get(heal_env.FROZEN_AFTER_ENV, "")
        try:  # the agent checked it; a stopped worker's heal begins this much later
            frozen_after = min(max(float(raw), 0.0), 86400.0) if raw else heal_env.DEFAULT_FROZEN_AFTER
        except ValueError:
            frozen_after = heal_env.DEFAULT_FROZEN_AFTER
        return cls(point, timeout=timeout, frozen_after=frozen_after, heal_wait=heal_wait)

    @property
    def replacement(self) -> bool:
        """Started by a heal: its state comes from a survivor."""
        return self.generation > 0

    @property
    def train_on(self) -> bool:
        return self.point.mode == heal_env.TRAIN_ON

    @property
    def joiner(self) -> bool:
        """A replacement of `train-on`: it waits until a grow admits it (`wait_to_join`)."""
        return self.train_on and self.replacement

    @property
    def me(self) -> str:
        """This process among the round's workers (heal_env.member_id)."""
        return heal_env.member_id(self.point.rank, self.point.generation)

    def first_group(self) -> dict[str, Any]:
        """`init_worker`'s arguments for this worker's first process group: the heal generation's
        (keep), the round's first view (train-on), or a group of its own (a joiner)."""
        if self.joiner:
            return {"store": dist.HashStore(), "place": (0, 1)}
        if self.train_on:
            return {"store": views.view_group_store(self.point.store, self.view, self.point.signed_records)}
        return {"store": regroup.heal_group_store(self.point.store, self.generation)}

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
            regroup.count_healer(self.point.signed_records, rank=self.point.rank, generation=self.generation)
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

    def regroup(self, ctx: WorkerContext, on: Callable[[Phase], None] = lambda phase: None) -> None:
        """Leave the broken group, wait for the agent's heal, join the next generation's group
        and give DDP a fresh reducer on it (`RegroupError` when the heal does not form). `on(phase)`:
        told as the wait (AWAITING) and the forming (FORMING) begin."""
        self.groups.leave(self._model)
        self.fault("during_heal")
        on(Phase.AWAITING)
        self.generation = regroup.next_generation(self.point, after=self.generation, timeout=self.begin_timeout)
        on(Phase.FORMING)
        regroup.rejoin(
            self.point.store, generation=self.generation, rank=ctx.rank, world_size=ctx.world_size,
            timeout=self._timeout, records=self.point.signed_records, groups=self.groups,
        )
        if self._model is not None:  # (armed: always, but for a test's ranks as threads, which train no model)
            ddp_rebind.rebind(self._model, self.guard)
        self.guard.clear()
        self.heals += 1

    def settle_buckets(self) -> None:
        """DDP's one-time bucket work, now (`ddp_rebind.settle_buckets`): a collective of the new group,
        before its members agree. Every member rebinds its DDP alike first (a survivor's was rebound
        at the heal, a replacement's just built: both in definition order)."""
        if self._model is None:
            return
        ddp_rebind.rebind(self._model, self.guard, reverse=True)
        ddp_rebind.settle_buckets(self._model)

    def agree(self, completed: int) -> catch_up.Agreement:
        """Every member's steps (a replacement gives -1: it completed none of its own)."""
        return catch_up.agree(completed, group=self.groups.group)

    # -- train-on: groups of views (elastic._worker.survivors.views) --------------------------------------------

    def leave_group(self) -> None:
        """Let go of the current group now (broken or not) and of DDP's hold on it."""
        self.groups.leave(self._model)

    def arrive(self, leaving: Callable[[], bool] = lambda: False) -> None:
        """This worker survived its view, which broke: count it in for the next one at once (before the
        slow teardown: survivors arrive close together). `RegroupError` when its own agent marked it
        failed, or is stopping it (`leaving`, see `shrink`): a peer on its node died."""
        if leaving():
            self.leave_node()
        self.arrive_check()
        try:
            views.arrive(self.point.signed_records, self.view, self.me)
        except RuntimeError as error:
            raise regroup.RegroupError(f"the rendezvous store failed while the survivors regrouped: "
                                       f"{first_line(error)}") from None
        self._arrived = True

    def arrive_check(self) -> None:
        """`RegroupError` when this worker's agent marked it failed (it is being replaced)."""
        try:
            replaced = views.failed(self.point.signed_records, self.me)
        except RuntimeError as error:
            raise regroup.RegroupError(f"the rendezvous store failed: {first_line(error)}") from None
        if replaced:
            raise regroup.RegroupError("this worker's agent is replacing it (a worker of its node failed)")

    def shrink(self, leaving: Callable[[], bool] = lambda: False) -> View:
        """The view after this worker's last one, which broke; it may not hold this worker. When
        `leaving()` (SIGTERM: torch's agent stops every worker of a node once one failed, before it
        replaces them) this worker leaves instead: `leave_node`."""
        arrived, self._arrived = self._arrived, False
        self.fault("during_heal")
        try:
            if leaving():
                self.leave_node()
            view = views.after_failure(self.point.signed_records, self.view, self.me, arrived_already=arrived, leaving=leaving)
            if view is None:
                self.leave_node()
        except RuntimeError as error:
            raise regroup.RegroupError(f"the rendezvous store failed while the survivors regrouped: "
                                       f"{first_line(error)}") from None
        assert view is not None
        return view

    def leave_node(self) -> NoReturn:
        """This worker's agent stops its node's workers: mark them all failed (they started together,
        with one incarnation), so the survivors stop waiting for any of them, and leave (`RegroupError`:
        the agent replaces them whatever the status)."""
        point = self.point
        first = point.rank - point.local_rank
        for rank in range(first, first + point.local_world_size):
            point.signed_records.set(heal_env.failed_key(heal_env.member_id(rank, point.generation)), "1")
        raise regroup.RegroupError("stopped by its agent while its group broke: a worker of its node failed")

    def grown(self, ctx: WorkerContext, upto: int) -> View | None:
        """The view that admits the joiners of tickets up to `upto` (rank 0 closes it, the others
        read it); every member of the current view calls this at the same step. None when rank 0
        wrote none in time (it died: the caller treats it as a failure and shrinks)."""
        store = self.point.signed_records
        try:
            if ctx.rank == 0:
                return joiners.admit(store, self.view, upto)
            return joiners.wait_view(store, self.view.number + 1, timeout=views.GATHER_SECONDS)
        except RuntimeError as error:
            raise regroup.RegroupError(f"the rendezvous store failed while a worker joined: {first_line(error)}") from None

    def wait_to_join(self, after: int) -> View | None:
        """Wait until a grow admits this worker: the view that does; None when the job ended first."""
        store = self.point.signed_records
        try:
            after = max(after, views.latest(store))
            ticket = joiners.register_joiner(store, self.me)
            return joiners.wait_for_admission(store, self.me, after=after, ticket=ticket,
                                              first=views.first_view(self.point.world_size),
                                              stale_after=self._timeout.total_seconds())
        except RuntimeError as error:
            raise regroup.RegroupError(f"the rendezvous store failed while this worker waited to join: "
                                       f"{first_line(error)}") from None

    def enter(self, view: View, ctx: WorkerContext) -> WorkerContext | None:
        """Form `view`'s group with its other members and give DDP a fresh reducer on it; this
        worker's context there, or None when a member did not come (then `shrink` from it)."""
        self.view = view
        rank = view.rank_of(self.me)
        assert rank is not None, "only a member enters a view"
        if view.world_size < self.point.min_world:
            raise regroup.RegroupError(
                f"view {view.number} has {view.world_size} workers, fewer than the job's minimum "
                f"{self.point.min_world}: a new round waits for nodes")
        regroup.require_left(f"view {view.number}", self.groups)
        try:
            if not views.gather(self.point.signed_records, view, self.me):
                return None
            # Formed within the gather's bound (a member that died after it came is marked failed by its
            # agent, and the watched store gives the group up then), then collectives get the job's own timeout.
            store = views.view_group_store(self.point.store, view, self.point.signed_records)
            self.groups.form(store, rank=rank, world_size=view.world_size, timeout=self._timeout,
                             form_within=timedelta(seconds=views.GATHER_SECONDS))
        except (RuntimeError, ValueError) as error:  # a member died after it came, or the store failed
            logger.warning("rank %d: the group of view %d did not form (%s)", ctx.rank, view.number, first_line(error))
            if self.groups.formed():
                self.groups.leave()
            return None
        if self._model is not None:
            ddp_rebind.rebind(self._model, self.guard)
        self.guard.clear()
        self.heals += 1
        return dataclasses.replace(ctx, rank=rank, world_size=view.world_size)

    def job_ended(self) -> None:
        """The job finished (rank 0, train-on): workers still waiting to join leave."""
        try:
            joiners.mark_ended(self.point.signed_records)
        except RuntimeError as error:  # they find out from the store's end instead
            logger.warning("could not tell waiting workers the job ended: %s", first_line(error))


def _copy(value: Any) -> Any:
    """A hyperparameter as of now (a tensor learning rate is changed in place by schedulers)."""
    return value.clone() if isinstance(value, torch.Tensor) else value
