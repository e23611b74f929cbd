"""The survivors' lifecycle (elastic._worker.survivors.lifecycle) and the changes that walk it
(elastic._worker.survivors.changes): the table refuses every move it does not list, and each path a
change takes (keep's heal, train-on's shrink, a grow, a replacement's way in, a group that breaks while
it forms or catches up, a change that gives up) moves through exactly the phases the table names.
Here on fakes of the group mechanics, in one process; tests/integration/test_heal_run.py and
test_train_on.py read the same paths from real jobs' `heal` events."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
import torch
from run_host_stub import RunHostStub

from elastic._worker.runtime.context import WorkerContext
from elastic._worker.survivors.catch_up import Agreement
from elastic._worker.survivors.changes import ATTEMPTS, GroupChanges, JobEnded
from elastic._worker.survivors.lifecycle import TRANSITIONS, IllegalMove, Lifecycle, Phase
from elastic._worker.survivors.regroup import GroupBroken, RegroupError
from elastic._worker.survivors.views import View

M, V, L, A, F, C = Phase.MEMBER, Phase.VOID, Phase.LEAVING, Phase.AWAITING, Phase.FORMING, Phase.CATCHING_UP


def test_the_table_allows_exactly_its_moves_and_left_from_anywhere() -> None:
    for start, to in itertools.product(Phase, Phase):
        lifecycle = Lifecycle()
        lifecycle.phase = start
        if to is Phase.LEFT or to in TRANSITIONS[start]:
            lifecycle.move(to)
            assert lifecycle.phase is to
        else:
            with pytest.raises(IllegalMove):
                lifecycle.move(to)
            assert lifecycle.phase is start
    assert not issubclass(IllegalMove, RuntimeError), "a healing loop must never swallow it as a broken group"


def test_the_path_starts_over_where_a_member_leaves() -> None:
    lifecycle = Lifecycle()
    for phase in (M, V, L, A, F, C, M, L, F, C, M):
        lifecycle.move(phase)
    assert lifecycle.path() == ["member", "leaving", "forming", "catching up", "member"]


CTX = WorkerContext(rank=0, local_rank=0, world_size=2, local_world_size=1, restart_count=0, run_id="t",
                    device=torch.device("cpu"), backend="gloo")


class FakeHealing:
    """The group mechanics, scripted: `enters` and `agrees` say what each attempt meets."""

    def __init__(self, *, train_on: bool, enters: list[bool] | None = None, agrees: list[bool] | None = None,
                 joiner_views: list[View | None] | None = None) -> None:
        self.train_on, self.generation, self.me = train_on, 1, "0.1"
        self.view = View(0, ("0.1", "1.1"))
        self.enters, self.agrees = list(enters or []), list(agrees or [])
        self.joiner_views = list(joiner_views or [])
        self.calls: list[str] = []

    def arrive(self, stopping: Any) -> None:
        self.calls.append("arrive")

    def arrive_check(self) -> None:
        pass

    def undo(self, *args: Any) -> None:
        self.calls.append("undo")

    def leave_group(self) -> None:
        self.calls.append("leave")

    def shrink(self, stopping: Any) -> View:
        return View(self.view.number + 1, ("0.1",))

    def grown(self, ctx: WorkerContext, upto: int) -> View:
        return View(self.view.number + 1, ("0.1", "1.1", "1.2"), grown=True)

    def wait_to_join(self, after: int) -> View | None:
        return self.joiner_views.pop(0)

    def enter(self, view: View, ctx: WorkerContext) -> WorkerContext | None:
        self.view = view
        ok = self.enters.pop(0) if self.enters else True
        return dataclasses.replace(ctx, world_size=view.world_size) if ok else None

    def regroup(self, ctx: WorkerContext, on: Any) -> None:
        on(Phase.AWAITING)
        self.generation += 1
        on(Phase.FORMING)

    def settle_buckets(self) -> None:
        pass

    def agree(self, completed: int) -> Agreement:
        if self.agrees and not self.agrees.pop(0):
            raise GroupBroken("a member died while the group caught up")
        return Agreement(fewest=completed, most=max(completed, 7), source=0)


def changes(healing: FakeHealing, *, at: Phase = M) -> tuple[GroupChanges, RunHostStub]:
    host, lifecycle = RunHostStub(CTX, 7), Lifecycle()
    lifecycle.phase = lifecycle.history[0] = at
    return GroupChanges(healing, host, (torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), None, None),
                        lifecycle), host


STARTED: Any = object()  # a void step's `before_step` (what undo puts back; the fake ignores it)


@pytest.mark.parametrize(("train_on", "started", "path"), [
    (False, STARTED, [M, V, L, A, F, C, M]),  # keep, the gradient all-reduce failed: await the agent's heal
    (False, None, [M, L, A, F, C, M]),  # keep, the step's bookkeeping failed
    (True, STARTED, [M, V, L, A, F, C, M]),  # train-on: await the next view of whoever arrived
    (True, None, [M, L, A, F, C, M]),
])
def test_a_failure_walks_leaving_awaiting_forming_catching_up_back_to_member(train_on: bool, started: Any,
                                                                               path: list[Phase]) -> None:
    group, host = changes(FakeHealing(train_on=train_on))
    group.failed(started, "Connection closed by peer")
    assert group.lifecycle.history == path
    assert host.emitted[-1]["phases"] == [phase.value for phase in path]


def test_a_view_a_member_never_came_to_awaits_the_next() -> None:
    group, _ = changes(FakeHealing(train_on=True, enters=[False, True]))
    group.failed(None, "broken")
    assert group.lifecycle.history == [M, L, A, F, A, F, C, M]


def test_a_group_that_breaks_while_it_catches_up_is_left_and_formed_again() -> None:
    group, _ = changes(FakeHealing(train_on=True, agrees=[False, True]))
    group.failed(None, "broken")
    assert group.lifecycle.history == [M, L, A, F, C, L, A, F, C, M]
    keep, _ = changes(FakeHealing(train_on=False, agrees=[False, True]))
    keep.failed(None, "broken")
    assert keep.lifecycle.history == [M, L, A, F, C, L, A, F, C, M]


def test_a_change_that_gives_up_leaves_the_survivors() -> None:
    group, _ = changes(FakeHealing(train_on=True, agrees=[False] * ATTEMPTS))
    with pytest.raises(RegroupError):
        group.failed(None, "broken")
    assert group.lifecycle.phase is Phase.LEFT


def test_a_grow_leaves_and_forms_the_known_view() -> None:
    group, _ = changes(FakeHealing(train_on=True))
    assert group.grow(5)
    assert group.lifecycle.history == [M, L, F, C, M]


def test_replacements_come_in_from_starting() -> None:
    joiner, _ = changes(FakeHealing(train_on=True, joiner_views=[View(3, ("1.1", "0.1"), grown=True)]),
                        at=Phase.STARTING)
    joiner.join()  # train-on: it awaits a grow that admits it
    assert joiner.lifecycle.history == [Phase.STARTING, A, F, C, M]
    keeper, _ = changes(FakeHealing(train_on=False), at=Phase.STARTING)
    assert keeper.catch_up_replacement() == 7  # keep: its group formed at start; it catches up
    assert keeper.lifecycle.history == [Phase.STARTING, C, M]
    ended, _ = changes(FakeHealing(train_on=True, joiner_views=[None]), at=Phase.STARTING)
    with pytest.raises(JobEnded):
        ended.join()
    assert ended.lifecycle.phase is Phase.LEFT
