"""The survivors plug-in of a `Run`: its group changes in its own processes (a peer died, or a worker waits to join).

A `Run` under torchrevive-run with `--survivors keep|train-on` (TORCHREVIVE_SURVIVORS)
holds one `Survivors` (`Survivors.from_environ`) and meets it only through
the hooks below, in the order it calls them; what the plug-in needs of the
run it gets through `RunHost`, a private adapter of the run (no public `Run`
member exists for it). elastic._worker.survivors.healing forms the groups,
elastic._worker.survivors.views says who is in them with train-on.

Hooks: `first_group` (the first process group's arguments), `prepare_ddp` and
`attach` (the model `run.ddp` builds), `fault_rank`, `arm` (in `Run.start`:
count this worker a healer, or why not), `join` / `catch_up_replacement` (a
replacement's state), `joiners_waiting` and `on_new_group` (what a group's
parts need), then per step `can_heal`, `before_step`, `void`, `failed`,
`grow_due` and `grow`, and `job_ended` in `Run.finish`. What they do:

- `failed(started, why)`: a collective of this worker failed (the gradient
  all-reduce, which made the step void, or the step's bookkeeping). The void
  step is undone; then with `keep` the group forms again at the same ranks once
  the dead worker's replacement came, and with `train-on` the survivors form a
  smaller group at once and train on. Every member takes the newest state from
  the lowest rank that completed the most steps, over the new group. True when
  the world size changed: the void step's batch is then another one.
- `grow(upto)` (train-on): at a vote step whose verdict names workers waiting
  to join, the next group holds them too; they take the state from a member.
- `join()` (train-on, a replacement in `Run.start`): wait until a grow admits
  this worker, then the same; the restore event says `"source": "live"`.

Invariants:
- Every member of a group changes group at the same step (a failure voids the
  same step everywhere; a grow happens at a vote step, which every rank reads
  alike), and the state after a change is one member's: nothing is read from disk.
- With train-on the data position is the sampler's, whatever the world size: the
  steps after a change take the rest of the epoch at the new size, every sample
  once (exactly-once, not bit-identical to a run that never changed size).
- A failure while a group forms or shares its state starts over from that
  group (keep: the next generation; train-on: the next view), at most
  `ATTEMPTS` times in a row; then `RegroupError` (exit status 76: a new round).
- A worker waiting to join when the job ends leaves with status 0 (`JobEnded`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Protocol

import torch

from elastic._shared.common.errors import first_line
from elastic._shared.protocol.fault_hook import NO_FAULTS
from elastic._worker.runtime.context import WorkerContext
from elastic._worker.survivors.healing import Healing, StepStart
from elastic._worker.survivors.regroup import GroupBroken, RegroupError
from elastic._worker.survivors.views import View, joiners_waiting

logger = logging.getLogger(__name__)

ATTEMPTS = 3  # groups in a row whose forming or catch-up broke (members died meanwhile) before a worker gives up


class JobEnded(SystemExit):
    """The job finished while this worker waited to join: there is nothing left to train (status 0)."""

    def __init__(self) -> None:
        super().__init__(0)


class _Watchdog(Protocol):
    def paused(self) -> AbstractContextManager[None]: ...


class RunHost(Protocol):
    """What `Survivors` needs of the run it serves; the run hands it a private adapter (elastic._worker.run.run)."""

    @property
    def ctx(self) -> WorkerContext: ...

    step: int
    """Steps completed by the whole job: set after a change to the step the new group goes on from."""

    @property
    def checkpoints(self) -> Any:
        """The current group's `CheckpointManager` (its `restore_live` takes a member's state)."""
        ...

    @property
    def events(self) -> Any: ...

    @property
    def watchdog(self) -> _Watchdog: ...

    def count_due_from(self, step: int) -> None:
        """`Run.due` is true only past `step`."""
        ...

    def rebuild_on_group(self, ctx: WorkerContext, earlier: Any | None) -> None:
        """The default group is new: this worker's place in it is `ctx`; build the step vote and a
        checkpoint manager on it (taking over from the `earlier` manager, if any)."""
        ...

    def drop_group_parts(self) -> None:
        """Before the group is left: the vote in flight is dropped and saves in flight abandoned."""
        ...

    def stopping(self) -> bool:
        """This worker received SIGTERM (its agent stops it, or its node is preempted)."""
        ...

    def forget_loss(self) -> None:
        """A void step's loss is not reported."""
        ...


class Survivors:
    """One worker's group changes in place (see the module docstring)."""

    def __init__(self, healing: Healing) -> None:
        self.healing = healing
        self._host: RunHost | None = None
        self._training: tuple[torch.optim.Optimizer, Any, Any] | None = None
        self._admitted_at = 0.0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], *, timeout: timedelta, heal_wait: timedelta) -> Survivors | None:
        """The plug-in when this worker's agent heals in place (it gave the worker a heal point); else None."""
        healing = Healing.from_environ(environ, timeout=timeout, heal_wait=heal_wait)
        return cls(healing) if healing is not None else None

    # -- hooks, in the order a run calls them ------------------------------------------------------

    @property
    def train_on(self) -> bool:
        return self.healing.train_on

    @property
    def joiner(self) -> bool:
        """A replacement of train-on: rank 0 of a group of its own until a grow admits it (writes no events)."""
        return self.healing.joiner

    def first_group(self) -> dict[str, Any]:
        """`init_worker`'s arguments for this worker's first process group."""
        return self.healing.first_group()

    def prepare_ddp(self, options: dict[str, Any]) -> None:
        """A replacement's DDP skips DDP's first broadcast: its state comes from a survivor in `Run.start`."""
        if self.healing.replacement:
            options.setdefault("init_sync", False)

    def attach(self, model: torch.nn.Module) -> None:
        """Reduce the gradients of `model` (run.ddp's) through the step guard."""
        self.healing.attach(model)

    def fault_rank(self) -> int:
        """The rank this worker started as (a chaos fault names it, whatever the group made of it since)."""
        return self.healing.point.rank

    def arm(self, host: RunHost, ctx: WorkerContext, training: tuple[torch.optim.Optimizer, Any, Any],
            faults: Any) -> None:
        """In `Run.start`, before the first step: count this worker a healer when it can heal (else a
        failure restarts every worker, as without the setting; a joiner that cannot has no group to join).
        `training`: the optimizer, scheduler and grad scaler a void step's undo puts back."""
        if not self.healing.arm(ctx, training[0]):
            if self.healing.joiner:
                raise RegroupError("a replacement that cannot heal in place has no group to join")
            return
        self._host, self._training = host, training
        if faults is not NO_FAULTS:  # the chaos suite's kills inside a gradient all-reduce and a heal
            self.healing.guard.before_reduce = lambda: faults.at("during_all_reduce", host.step + 1)
            self.healing.fault = lambda point: faults.at(point, host.step + 1)

    @property
    def armed(self) -> bool:
        return self._host is not None

    @property
    def replaces_a_worker(self) -> bool:
        """Armed, and started by a heal (keep): its state comes from a survivor's memory."""
        return self.armed and self.healing.replacement

    def joiners_waiting(self, ctx: WorkerContext) -> Callable[[], int] | None:
        """What rank 0's step vote asks each vote step (train-on): the newest ticket of a worker waiting to join."""
        if self.healing.train_on and ctx.is_main:
            records = self.healing.point.signed_records
            return lambda: joiners_waiting(records)
        return None

    def on_new_group(self, ctx: WorkerContext, events: Any, path: Any) -> None:
        """With train-on the group's rank 0 writes the event log (rank 0 may be another worker now)."""
        if self.healing.train_on:
            events.write_to(path if ctx.is_main else None)

    @property
    def can_heal(self) -> bool:
        """Armed and counted: a failed collective is healed in place, not a restart."""
        return self.armed and self.healing.ready

    def before_step(self, device: torch.device) -> StepStart:
        """What a void step's undo puts back (the step's settings, scheduler, scaler and RNG states)."""
        assert self._training is not None
        optimizer, scheduler, scaler = self._training
        return self.healing.before_step(device, optimizer, scheduler, scaler)

    @property
    def void(self) -> bool:
        """The step just trained failed on this rank (its gradient all-reduce did)."""
        return self.healing.void

    @property
    def void_reason(self) -> str | None:
        return self.healing.guard.error

    def void_step(self, why: str) -> None:
        """A collective between steps (a pause's) failed before the update of the step whose batch the script
        holds: that step is void on this rank (its gradient all-reduce does not wait on the broken group), and
        `failed` heals the group after it, as for a failed gradient all-reduce."""
        self.healing.guard.failed(RuntimeError(why))

    def grow_due(self, joiners: int) -> bool:
        """At a vote step: workers waiting to join (tickets up to `joiners`) were not considered yet."""
        return self.armed and self.healing.train_on and joiners > self.healing.view.considered

    def job_ended(self, ctx: WorkerContext) -> None:
        """In `Run.finish`: workers still waiting to join leave (train-on, rank 0)."""
        if self.healing.train_on and ctx.is_main:
            self.healing.job_ended()

    # -- what the hooks do ---------------------------------------------------------------------------

    @property
    def run(self) -> RunHost:
        assert self._host is not None, "Survivors.arm comes first"
        return self._host

    def _undo(self, started: StepStart) -> None:
        """A void step: put back what it changed besides the parameters (Healing.undo); its loss is dropped."""
        assert self._training is not None
        optimizer, scheduler, scaler = self._training
        self.healing.undo(started, self._ctx.device, optimizer, scheduler, scaler)
        self.run.forget_loss()

    @property
    def _ctx(self) -> WorkerContext:
        return self.run.ctx

    def failed(self, started: StepStart | None, why: str | None) -> bool:
        """A collective failed; `started`: the void step's `before_step` (None: the step completed and
        its bookkeeping failed). True when this worker's rank or the world size changed."""
        run, healing = self.run, self.healing
        began, place = time.perf_counter(), (self._ctx.rank, self._ctx.world_size)
        if healing.train_on:
            healing.arrive(run.stopping)  # first: the survivors arrive at the next view close together
        if started is not None:
            self._undo(started)
        logger.warning("rank %d: step %d %s (%s); %s", self._ctx.rank, run.step + 1,
                       "is void" if started is not None else "ended, its bookkeeping failed", why,
                       "training on without the failed workers" if healing.train_on else "healing in place")
        with run.watchdog.paused():
            if healing.train_on:
                earlier = run.checkpoints
                run.drop_group_parts()
                healing.leave_group()
                self._settle(healing.shrink(run.stopping), completed=run.step, replacement=False, earlier=earlier)
            else:
                self._regroup()
                run.step = self._catch_up(run.step, replacement=False)
                run.count_due_from(run.step)  # as every member of the healed group (see `_settle`)
        grown = healing.train_on and healing.view.grown  # (it came late, and a grow admitted it)
        self._report(began, "grow" if grown else "shrink" if self._ctx.world_size < place[1] else "heal")
        return (self._ctx.rank, self._ctx.world_size) != place

    def grow(self, upto: int) -> bool:
        """Every member at the same vote step: admit the joiners of tickets up to `upto`. True when the
        group changed (False: none of them could be admitted, the group stays as it is)."""
        run, healing = self.run, self.healing
        began = time.perf_counter()
        with run.watchdog.paused():
            earlier = run.checkpoints
            earlier.flush()  # saves in flight commit on this group first (its members are all alive)
            view = healing.grown(self._ctx, upto)
            if view is not None and view.members == healing.view.members:
                healing.view = view  # its tickets were considered (dead joiners): the group stays as it is
                return False
            earlier.close()
            run.drop_group_parts()
            healing.leave_group()
            if view is None:  # rank 0 never wrote it: it died; the others go on without it
                view = healing.shrink(run.stopping)
            self._settle(view, completed=run.step, replacement=False, earlier=earlier)
        self._report(began, "grow")
        return True

    def join(self) -> None:
        """A replacement with train-on (in `Run.start`): wait to be admitted, then take the state. When
        it is the grown group's rank 0 it writes the grow's `heal` event (its seconds: from the moment it
        saw itself admitted, about the members' pause)."""
        self.healing.leave_group()  # the group of its own it held meanwhile
        self._settle(None, completed=-1, replacement=True, earlier=None)
        self._report(self._admitted_at, "grow" if self.healing.view.grown else "shrink")

    def _settle(self, view: View | None, *, completed: int, replacement: bool, earlier: Any | None) -> None:
        """Form `view` (None, or one without this worker: wait to be admitted) and take the newest state
        there; a view that breaks meanwhile is left for the next one.

        Where `Run.due` counts from is the same on every member after (a script's evaluation at a
        `due` step is a collective): a group formed after a failure skips the step it goes on from
        (those that trained a void step looked at it before); one grown at a step's bookkeeping does
        not (its members look at that step next, and the workers that joined count from the step
        before it, as they do)."""
        run, healing = self.run, self.healing
        why, joined = "", False
        for attempt in range(1, ATTEMPTS + 1):
            if view is None or view.rank_of(healing.me) is None:
                if view is not None:
                    healing.arrive_check()  # left out because its agent is replacing it: it leaves
                    logger.warning("rank %d came after view %d closed; it joins at a later step",
                                   self._ctx.rank, view.number)
                view = healing.wait_to_join(after=view.number if view is not None else 0)
                self._admitted_at, joined = time.perf_counter(), True
                if view is None:
                    logger.warning("the job ended while this worker waited to join: nothing left to train")
                    raise JobEnded()
                replacement = replacement or completed >= 0  # a late survivor is behind: it takes the state
            ctx = healing.enter(view, self._ctx)
            if ctx is not None:
                try:
                    run.rebuild_on_group(ctx, earlier)  # (its process groups are collectives: a member may be gone)
                    earlier = run.checkpoints
                    healing.settle_buckets()
                    agreed = healing.agree(completed)
                    if agreed.most < 0:
                        raise RegroupError(f"view {view.number}: no member holds any state; a new round restores it")
                    run.step = run.checkpoints.restore_live(
                        source=agreed.source, step=agreed.most, take=replacement or completed < agreed.most,
                        replacement=replacement, new_tag=True,
                    )
                    if not view.grown:
                        run.count_due_from(run.step)
                    elif joined:
                        run.count_due_from(run.step - 1)
                    return
                except (RuntimeError, GroupBroken) as error:
                    why = first_line(error)
                # Out of the `except` block: its traceback holds the broken group, whose sockets must
                # close for the members still waiting in it to fail now.
                run.drop_group_parts()
                healing.leave_group()
            else:
                why = f"a member of view {view.number} did not come"
            if attempt == ATTEMPTS:  # (without arriving at the next view: the others need not wait for it)
                break
            logger.warning("rank %d: view %d broke (%s); forming the next one", self._ctx.rank, view.number, why)
            healing.arrive(run.stopping)
            view, joined = healing.shrink(run.stopping), False
        raise RegroupError(f"{ATTEMPTS} groups in a row broke while they formed: {why}")

    # -- keep: the same ranks, once the replacement came -------------------------------------------

    def _regroup(self) -> None:
        """Form the next heal's group, and build on it what met on the broken one."""
        run = self.run
        earlier = run.checkpoints
        run.drop_group_parts()
        self.healing.regroup(self._ctx)
        run.rebuild_on_group(self._ctx, earlier)

    def catch_up_replacement(self) -> int:
        """A replacement with keep (in `Run.start`): the state of a survivor, from its memory."""
        return self._catch_up(-1, replacement=True)

    def _catch_up(self, completed: int, *, replacement: bool) -> int:
        """Every member of the new group takes the newest state (from the lowest rank that has it);
        the step to go on from. A member that dies meanwhile breaks the group: the heal starts over
        with the next generation, at most `ATTEMPTS` times."""
        healing = self.healing
        for attempt in range(1, ATTEMPTS + 1):
            try:
                healing.settle_buckets()
                agreed = healing.agree(completed)
                if agreed.most < 0:  # every member is a replacement: nobody holds the state
                    raise RegroupError(f"heal {healing.generation}: no member holds any state (every worker was "
                                       "replaced); a new round restores it")
                return self.run.checkpoints.restore_live(
                    source=agreed.source, step=agreed.most, take=replacement or completed < agreed.most,
                    replacement=replacement,
                )
            except (RuntimeError, GroupBroken) as error:
                why = first_line(error)
            # Out of the `except` block (see `_settle`).
            if attempt == ATTEMPTS:
                raise RegroupError(f"heal {healing.generation} broke {attempt} times: {why}")
            logger.warning("rank %d: heal %d broke (%s); starting over", self._ctx.rank, healing.generation, why)
            self._regroup()
        raise AssertionError("unreachable")

    def _report(self, began: float, change: str) -> None:
        """The `heal` event and line: how the group changed, and what it cost."""
        ctx, healing, seconds = self._ctx, self.healing, time.perf_counter() - began
        number = healing.view.number if healing.train_on else healing.generation
        self.run.events.emit("heal", step=self.run.step, world_size=ctx.world_size, generation=number,
                             change=change, seconds=seconds)
        if ctx.is_main:
            logger.info("%s in place (%s %d) in %.2f s: training on from step %d at world size %d",
                        {"heal": "healed", "shrink": "shrank", "grow": "grew"}[change],
                        "view" if healing.train_on else "heal", number, seconds, self.run.step, ctx.world_size)
