"""A loop part's vote on three ranks (threads of this process, a real gloo group each): one rank's part
votes to stop, and every rank's parts answer STOP at the same step, by the step vote's MAX alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from thread_ranks import run_ranks

from elastic._worker.control.step_vote import Ballot, StepVote
from elastic._worker.run.parts import Change, LoopPartBase, Parts
from elastic._worker.runtime.context import WorkerContext


class StopAfter(LoopPartBase):
    """Votes to stop once it saw `last` steps end (a part a script could write)."""

    def __init__(self, last: int) -> None:
        self.last, self.steps = last, 0

    def step_ended(self, step: int) -> None:
        self.steps += 1

    def ballot_size(self, world_size: int) -> int:
        return 1

    def ballot(self) -> Sequence[int]:
        return [int(self.steps >= self.last)]

    def after_step(self, step: int, ballots: tuple[int, ...] | None) -> Change:
        return Change.STOP if ballots and ballots[0] else Change.NONE


class Tally(LoopPartBase):
    """A slot per rank, each rank's own count in its slot: the MAX hands every rank every rank's count."""

    def __init__(self) -> None:
        self.rank, self.world_size, self.read = 0, 1, []

    def on_group(self, ctx: WorkerContext) -> None:
        self.rank, self.world_size = ctx.rank, ctx.world_size

    def ballot_size(self, world_size: int) -> int:
        return world_size

    def ballot(self) -> Sequence[int]:
        return [10 + self.rank if slot == self.rank else 0 for slot in range(self.world_size)]

    def after_step(self, step: int, ballots: tuple[int, ...] | None) -> Change:
        if ballots is not None:
            self.read.append(ballots)
        return Change.NONE


def loop(ctx: WorkerContext, group: Any) -> tuple[int, list[tuple[int, ...]]]:
    tally = Tally()
    parts = Parts([tally, StopAfter(4 if ctx.rank == 2 else 10**6)])
    parts.on_group(ctx)
    now = [0.0]
    vote = StepVote(ctx, Ballot, grace=15.0, clock=lambda: now[0], group=group,
                    slots=parts.ballots)
    for step in range(1, 60):
        parts.before_step(step - 1)
        now[0] += 0.3  # a 0.3 s step: votes a few steps apart once the ranks agreed on it
        parts.step_ended(step)
        verdict = vote.step_ended(step)
        if parts.after_step(step, verdict.slots) == Change.STOP:
            vote.settle()
            return step, tally.read
    raise AssertionError("no rank stopped")


def test_one_ranks_part_stops_every_rank_at_the_same_step() -> None:
    results = run_ranks(3, loop)
    stops = {step for step, _ in results}
    assert len(stops) == 1 and min(stops) >= 4  # read one vote later, on a vote step: the same one everywhere
    for _, read in results:
        assert read and all(ballots == (10, 11, 12) for ballots in read)  # the per-rank slots, gathered
    assert len({tuple(read) for _, read in results}) == 1
