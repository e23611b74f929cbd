"""The survivors as a loop part (elastic._worker.run.survivors_part): what it answers at each hook,
on a scripted plug-in. A void step heals first and answers VOID; a failed collective of the
bookkeeping is healed only when the worker can heal; with train-on the newest joiner ticket rides on
the vote as the part's one slot (rank 0's reading), and the group grows once, after the step's saves."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from elastic._shared.common.errors import UsageError
from elastic._worker.run.parts import Change, Kind, Parts
from elastic._worker.run.survivors_part import SurvivorsHost, SurvivorsPart
from elastic._worker.runtime.context import WorkerContext


def ctx(rank: int, world_size: int = 2) -> WorkerContext:
    return WorkerContext(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size,
                         restart_count=0, run_id="t", device=torch.device("cpu"), backend="gloo")


class FakeSurvivors:
    """The plug-in's hooks, scripted: `failed_resizes` is what a heal answers; tickets are `waiting`."""

    def __init__(self, *, train_on: bool, can_heal: bool = True, failed_resizes: bool = False) -> None:
        self.train_on, self.can_heal, self.failed_resizes = train_on, can_heal, failed_resizes
        self.void, self.void_reason, self.waiting, self.considered = False, None, 0, 0
        self.calls: list[tuple[Any, ...]] = []

    def joiners_waiting(self, context: WorkerContext) -> Any:
        return (lambda: self.waiting) if self.train_on and context.is_main else None

    def on_new_group(self, context: WorkerContext, events: Any, path: Any) -> None:
        self.calls.append(("on_new_group", context.rank))

    def before_step(self, device: torch.device) -> str:
        return "started"

    def failed(self, started: Any, why: Any) -> bool:
        self.calls.append(("failed", started, why))
        return self.failed_resizes

    def grow_due(self, joiners: int) -> bool:
        return self.train_on and joiners > self.considered

    def grow(self, upto: int) -> bool:
        self.calls.append(("grow", upto))
        self.considered = upto
        return True


def part_of(survivors: FakeSurvivors, rank: int = 0) -> SurvivorsPart:
    core: Any = SimpleNamespace(context=ctx(rank), events=None, config=SimpleNamespace(events=None))
    part = SurvivorsPart(survivors, core)  # type: ignore[arg-type]
    part.on_group(ctx(rank))
    return part


def test_a_void_step_is_healed_then_answered_void_and_a_completed_step_is_not() -> None:
    survivors = FakeSurvivors(train_on=False)
    part = part_of(survivors)
    part.before_step(4)
    assert part.body_ended(4) == Change.NONE and not [c for c in survivors.calls if c[0] == "failed"]
    part.before_step(4)
    survivors.void, survivors.void_reason = True, "Connection closed by peer"
    assert part.body_ended(4) == Change.VOID
    assert survivors.calls[-1] == ("failed", "started", "Connection closed by peer")  # the undo's record handed on


def test_a_worker_that_cannot_heal_answers_nothing_and_heals_nothing() -> None:
    survivors = FakeSurvivors(train_on=False, can_heal=False)
    part = part_of(survivors)
    part.before_step(0)
    survivors.void = True  # (cannot happen unarmed; even so nothing is healed)
    assert part.body_ended(0) == Change.NONE
    assert part.collective_failed("Connection reset") is None  # the error stands: a restart
    assert not [c for c in survivors.calls if c[0] == "failed"]


@pytest.mark.parametrize(("resizes", "answer"), [(False, Change.NONE), (True, Change.RESHARD)])
def test_a_failed_collective_of_the_bookkeeping_heals_and_says_whether_the_place_changed(resizes: bool,
                                                                                          answer: Change) -> None:
    survivors = FakeSurvivors(train_on=True, failed_resizes=resizes)
    assert part_of(survivors).collective_failed("Broken pipe") == answer
    assert survivors.calls[-1] == ("failed", None, "Broken pipe")  # the step completed: nothing to undo


def test_with_train_on_rank_0_reads_the_newest_ticket_onto_the_vote_and_every_rank_grows_once() -> None:
    survivors = FakeSurvivors(train_on=True)
    survivors.waiting = 3
    main, other = part_of(survivors, rank=0), part_of(FakeSurvivors(train_on=True), rank=1)
    assert main.ballot_size(2) == other.ballot_size(2) == 1  # as long on every rank
    assert list(main.ballot()) == [3] and list(other.ballot()) == [0]  # MAX over the ranks: rank 0's reading
    assert main.step_done(6) == Change.NONE, "no vote carried a ticket yet"
    main.after_step(7, None)  # off a vote step: nothing learned
    main.after_step(8, (3,))
    assert main.step_done(8) == Change.RESHARD and survivors.calls[-1] == ("grow", 3)
    main.after_step(9, (3,))  # the same ticket again: already considered
    assert main.step_done(9) == Change.NONE and [c for c in survivors.calls if c[0] == "grow"] == [("grow", 3)]


def test_keep_puts_nothing_on_the_vote_and_train_on_needs_a_loader_that_follows_the_shares() -> None:
    keep = part_of(FakeSurvivors(train_on=False))
    assert keep.ballot_size(4) == 0
    keep.loop_started(0, resizable=False)
    train_on = part_of(FakeSurvivors(train_on=True))
    with pytest.raises(UsageError, match="train-on needs the loader"):
        train_on.loop_started(0, resizable=False)
    parts = Parts([keep, train_on])
    parts.on_group(ctx(0))
    assert parts.ballots() == [0] and parts.after_step(1, (5,)).kind is Kind.NONE


def test_the_host_says_not_stopping_before_the_sigterm_handler_is_installed() -> None:
    """A train-on joiner waits to be admitted inside `Run.start`, before the handler is installed; a view
    that breaks meanwhile asks whether it is stopping (the soak: it died of an AssertionError instead)."""
    core: Any = SimpleNamespace(preemption=None)
    host = SurvivorsHost(core)
    assert host.stopping() is False
    core.preemption = SimpleNamespace(signalled=True)
    assert host.stopping() is True
