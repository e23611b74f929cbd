"""How one worker's group changes in place, phase by phase (elastic._worker.survivors.lifecycle).

The survivors plug-in (elastic._worker.survivors.plugin) calls these at its hooks; `Healing`
(elastic._worker.survivors.healing) forms the groups, elastic._worker.survivors.views says who is in
them with train-on, and `RunHost` is what a change reaches of the run.

- `failed(started, why)`: a collective of this worker failed (the gradient all-reduce, which made the
  step VOID, or the step's bookkeeping). The void step is undone; then with `keep` the group forms
  again at the same ranks once the dead worker's replacement came, and with `train-on` the survivors
  form a smaller group at once and train on. Every member takes the newest state from the lowest rank
  that completed the most steps, over the new group. True when the world size changed.
- `grow(upto)` (train-on): at a vote step whose verdict names workers waiting to join, the next group
  holds them too; they take the state from a member.
- `join()` (train-on, a replacement in `Run.start`) and `catch_up_replacement()` (keep): a
  replacement's way in.

Invariants:
- Every member of a group changes group at the same step, and the state after a change is one
  member's: nothing is read from disk.
- A failure while a group forms or shares its state starts over from that group (keep: the next
  generation; train-on: the next view), at most `ATTEMPTS` times in a row; then `RegroupError` (exit
  status 76: a new round), and the lifecycle is LEFT.
- Every move goes through `Lifecycle.move`; the `heal` event carries the change's path of phases.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from elastic._shared.common.errors import first_line
from elastic._worker.runtime.context import WorkerContext
from elastic._worker.survivors.healing import Healing, StepStart
from elastic._worker.survivors.lifecycle import Lifecycle, Phase
from elastic._worker.survivors.regroup import GroupBroken, RegroupError
from elastic._worker.survivors.views import View

logger = logging.getLogger(__name__)

ATTEMPTS = 3  # groups in a row whose forming or catch-up broke (members died meanwhile) before a worker gives up


class _Watchdog(Protocol):
    def paused(self) -> AbstractContextManager[None]: ...


class RunHost(Protocol):
    """What `Survivors` needs of the run it serves; the run hands it an adapter (elastic._worker.run.survivors_part)."""

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


class JobEnded(SystemExit):
    """The job finished while this worker waited to join: there is nothing left to train (status 0)."""

    def __init__(self) -> None:
        super().__init__(0)


class GroupChanges:
    """One worker's group changes (see the module docstring)."""

    def __init__(self, healing: Healing, host: RunHost, training: tuple[torch.optim.Optimizer, Any, Any],
                 lifecycle: Lifecycle) -> None:
        self.healing, self.run, self.lifecycle = healing, host, lifecycle
        self._training = training
        self._admitted_at = 0.0

    @property
    def _ctx(self) -> WorkerContext:
        return self.run.ctx

    def armed(self) -> None:
        """`Survivors.arm`: a member of the round's first group is a MEMBER now (a replacement comes in its
        own way: `join`, `catch_up_replacement`)."""
        if not self.healing.joiner and not self.healing.replacement:
            self.lifecycle.move(Phase.MEMBER)

    def _move(self, to: Phase) -> None:
        if self.lifecycle.phase is not to:  # (a late survivor left out of a view awaits on)
            self.lifecycle.move(to)

    @contextmanager
    def _change(self) -> Iterator[None]:
        """A change that ends this worker's part in the survivors (a new round, the job's end) leaves it LEFT."""
        try:
            yield
        except (RegroupError, JobEnded):
            self.lifecycle.move(Phase.LEFT)
            raise

    def _undo(self, started: StepStart) -> None:
        """A void step: put back what it changed besides the parameters (Healing.undo); its loss is dropped."""
        optimizer, scheduler, scaler = self._training
        self.healing.undo(started, self._ctx.device, optimizer, scheduler, scaler)
        self.run.forget_loss()

    def failed(self, started: StepStart | None, why: str | None) -> bool:
        """A collective failed; `started`: the void step's `before_step` (None: the step completed and
        its bookkeeping failed). True when this worker's rank or the world size changed."""
        with self._change():
            return self._failed(started, why)

    def _failed(self, started: StepStart | None, why: str | None) -> bool:
        run, healing = self.run, self.healing
        began, place = time.perf_counter(), (self._ctx.rank, self._ctx.world_size)
        if started is not None:
            self.lifecycle.move(Phase.VOID)
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
                self.lifecycle.move(Phase.LEAVING)
                healing.leave_group()
                self.lifecycle.move(Phase.AWAITING)  # train-on's policy: the next view of whoever arrives
                self._settle(healing.shrink(run.stopping), completed=run.step, replacement=False, earlier=earlier)
            else:
                run.step = self._catch_up(run.step, replacement=False, regroup_first=True)
                run.count_due_from(run.step)  # as every member of the healed group (see `_settle`)
        grown = healing.train_on and healing.view.grown  # (it came late, and a grow admitted it)
        self._report(began, "grow" if grown else "shrink" if self._ctx.world_size < place[1] else "heal")
        return (self._ctx.rank, self._ctx.world_size) != place

    def grow(self, upto: int) -> bool:
        """Every member at the same vote step: admit the joiners of tickets up to `upto`. True when the
        group changed (False: none of them could be admitted, the group stays as it is)."""
        run, healing = self.run, self.healing
        began = time.perf_counter()
        with self._change(), run.watchdog.paused():
            earlier = run.checkpoints
            earlier.flush()  # saves in flight commit on this group first (its members are all alive)
            view = healing.grown(self._ctx, upto)
            if view is not None and view.members == healing.view.members:
                healing.view = view  # its tickets were considered (dead joiners): the group stays as it is
                return False
            earlier.close()
            run.drop_group_parts()
            self.lifecycle.move(Phase.LEAVING)
            healing.leave_group()
            if view is None:  # rank 0 never wrote it: it died; the others go on without it
                self.lifecycle.move(Phase.AWAITING)
                view = healing.shrink(run.stopping)
            self._settle(view, completed=run.step, replacement=False, earlier=earlier)
        self._report(began, "grow")
        return True

    def join(self) -> None:
        """A replacement with train-on (in `Run.start`): wait to be admitted, then take the state. When
        it is the grown group's rank 0 it writes the grow's `heal` event (its seconds: from the moment it
        saw itself admitted, about the members' pause)."""
        with self._change():
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
                self._move(Phase.AWAITING)  # an admission, by a later grow
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
            self.lifecycle.move(Phase.FORMING)
            ctx = healing.enter(view, self._ctx)
            if ctx is not None:
                try:
                    run.rebuild_on_group(ctx, earlier)  # (its process groups are collectives: a member may be gone)
                    earlier = run.checkpoints
                    self.lifecycle.move(Phase.CATCHING_UP)
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
                    self.lifecycle.move(Phase.MEMBER)
                    return
                except (RuntimeError, GroupBroken) as error:
                    why = first_line(error)
                # Out of the `except` block: its traceback holds the broken group, whose sockets must
                # close for the members still waiting in it to fail now.
                run.drop_group_parts()
                self.lifecycle.move(Phase.LEAVING)
                healing.leave_group()
            else:
                why = f"a member of view {view.number} did not come"
            if attempt == ATTEMPTS:  # (without arriving at the next view: the others need not wait for it)
                break
            logger.warning("rank %d: view %d broke (%s); forming the next one", self._ctx.rank, view.number, why)
            healing.arrive(run.stopping)
            self.lifecycle.move(Phase.AWAITING)
            view, joined = healing.shrink(run.stopping), False
        raise RegroupError(f"{ATTEMPTS} groups in a row broke while they formed: {why}")

    # -- keep: the same ranks, once the replacement came -------------------------------------------

    def _regroup(self) -> None:
        """Form the next heal's group, and build on it what met on the broken one."""
        run = self.run
        earlier = run.checkpoints
        run.drop_group_parts()
        self.lifecycle.move(Phase.LEAVING)
        self.healing.regroup(self._ctx, on=self.lifecycle.move)  # keep's policy: await the agent's heal
        run.rebuild_on_group(self._ctx, earlier)

    def catch_up_replacement(self) -> int:
        """A replacement with keep (in `Run.start`): the state of a survivor, from its memory."""
        with self._change():
            return self._catch_up(-1, replacement=True)

    def _catch_up(self, completed: int, *, replacement: bool, regroup_first: bool = False) -> int:
        """(`regroup_first`: form the next heal's group first, then) every member of the new group takes
        the newest state (from the lowest rank that has it); the step to go on from. A member that dies
        meanwhile breaks the group (or gives up the one forming: regroup's `GroupBroken`): the heal starts
        over with the next generation, at most `ATTEMPTS` times."""
        healing = self.healing
        for attempt in range(1, ATTEMPTS + 1):
            try:
                if regroup_first or attempt > 1:
                    self._regroup()
                self.lifecycle.move(Phase.CATCHING_UP)
                healing.settle_buckets()
                agreed = healing.agree(completed)
                if agreed.most < 0:  # every member is a replacement: nobody holds the state
                    raise RegroupError(f"heal {healing.generation}: no member holds any state (every worker was "
                                       "replaced); a new round restores it")
                step = self.run.checkpoints.restore_live(
                    source=agreed.source, step=agreed.most, take=replacement or completed < agreed.most,
                    replacement=replacement,
                )
                self.lifecycle.move(Phase.MEMBER)
                return step
            except (RuntimeError, GroupBroken) as error:
                why = first_line(error)
            # Out of the `except` block (see `_settle`).
            if attempt == ATTEMPTS:
                raise RegroupError(f"heal {healing.generation} broke {attempt} times: {why}")
            logger.warning("rank %d: heal %d broke (%s); starting over", self._ctx.rank, healing.generation, why)
        raise AssertionError("unreachable")

    def _report(self, began: float, change: str) -> None:
        """The `heal` event and line: how the group changed, its path of phases, and what it cost."""
        ctx, healing, seconds = self._ctx, self.healing, time.perf_counter() - began
        number = healing.view.number if healing.train_on else healing.generation
        self.run.events.emit("heal", step=self.run.step, world_size=ctx.world_size, generation=number,
                             change=change, seconds=seconds, phases=self.lifecycle.path())
        if ctx.is_main:
            logger.info("%s in place (%s %d) in %.2f s: training on from step %d at world size %d",
                        {"heal": "healed", "shrink": "shrank", "grow": "grew"}[change],
                        "view" if healing.train_on else "heal", number, seconds, self.run.step, ctx.world_size)
