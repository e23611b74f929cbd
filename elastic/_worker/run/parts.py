"""The seam between a run's step loop and its parts: the hooks a `LoopPart` is called at, and the
`Change` it answers with.

A part is anything that acts at steps: it sees each step start and end, may put a few integers on
the step vote (each rank's, MAX-reduced element-wise over the group) and reads the result, and it
answers each step's end with a `Change` the loop acts on. A part never calls back into the run: what
it may read of the run is the `RunCore` it is handed at `start`, and what it may do to the loop is
its answer.

    class StopAt(LoopPartBase):               # every rank leaves the loop at the same step
        def ballot_size(self, world_size): return 1
        def ballot(self): return [int(self.steps >= self.last)]
        def after_step(self, step, ballots):
            self.steps += 1
            return Change.STOP if ballots and ballots[0] else Change.NONE

    with elastic.Run(parts=[StopAt(5)]) as run: ...

Order of calls, on every rank alike: `on_group` (the first group, and each formed in place), `start`
(once, in `Run.start`, after the restore), `loop_started` (each `run.batches` loop), then per step
`before_step`, `body_ended` (the script's body is done, the step not counted yet: a part may answer
VOID there, the step did not happen), `step_ended` (the step counted, before the vote; a part may
answer REWIND there), `ballot` (on a vote step, as the vote is cast), `after_step` (after the vote,
before saves), `step_done` (the step's saves started), and `finish` (in `Run.finish`, before the
final save). A collective of the bookkeeping that fails is offered to `collective_failed` (a part
that heals the group answers; else the error stands). The built-in parts (builtin_parts.py:
`--slow-ranks`, the integrity checks; survivors_part.py: the survivors' group changes) come first,
a script's own after them.

Invariants:
- A part's `ballot_size` depends only on the world size, and is the same on every rank of a group, so
  every rank's ballot is as long; `Parts` pads or cuts a ballot to its declared size.
- `after_step` gets the part's slice of the vote's verdict on a vote step, the same on every rank, and
  None on the other steps: a part that decides from its slice alone decides alike on every rank.
- The loop acts on the strongest change any part answered: STOP over REWIND over RESHARD over NONE.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from elastic._worker.runtime.context import WorkerContext


class Kind(enum.IntEnum):
    """What a part asks of the loop at a step's end (a larger value wins)."""

    NONE = 0
    RESHARD = 1
    """This rank's share of the steps to come changed: the loader opens again at the new shares."""
    REWIND = 2
    """Every rank's state went back to an earlier step (`Change.to`): the loop goes on from there, the
    step's vote and saves skipped, its loader opened again at that step."""
    VOID = 3
    """(`body_ended` only) The step did not happen on this rank's group: it is not counted, and the loop
    trains its batch again, unless the group changed this rank's place (its loader opens again at the
    new shares) or the step count moved (the state of a newer step was taken from a peer)."""
    STOP = 4
    """Every rank leaves the loop after this step (as if its step limit were reached)."""


@dataclass(frozen=True)
class Change:
    """A part's answer at a step's end: a value the loop acts on (`Change.NONE`, `.RESHARD`, `.STOP`,
    `Change.rewind(to)`)."""

    kind: Kind
    to: int | None = None
    """REWIND: the step every rank went back to."""

    NONE: ClassVar[Change]
    RESHARD: ClassVar[Change]
    VOID: ClassVar[Change]
    STOP: ClassVar[Change]

    @classmethod
    def rewind(cls, to: int) -> Change:
        return cls(Kind.REWIND, to)

    def __or__(self, other: Change) -> Change:
        """The stronger of two answers (the first of equal ones)."""
        return other if other.kind > self.kind else self


Change.NONE, Change.RESHARD, Change.VOID, Change.STOP = (Change(Kind.NONE), Change(Kind.RESHARD), Change(Kind.VOID),
                                                         Change(Kind.STOP))


class LoopPart(Protocol):
    """A part of the step loop (see the module docstring)."""

    def on_group(self, ctx: WorkerContext) -> None: ...

    def start(self, core: Any) -> None: ...

    def loop_started(self, step: int, *, resizable: bool) -> None: ...

    def before_step(self, step: int) -> None: ...

    def body_ended(self, step: int) -> Change: ...

    def step_ended(self, step: int) -> Change: ...

    def ballot_size(self, world_size: int) -> int: ...

    def ballot(self) -> Sequence[int]: ...

    def after_step(self, step: int, ballots: tuple[int, ...] | None) -> Change: ...

    def step_done(self, step: int) -> Change: ...

    def collective_failed(self, why: str) -> Change | None: ...

    def finish(self) -> None: ...


class LoopPartBase:
    """A part whose every hook does nothing: a part overrides the ones it uses."""

    def on_group(self, ctx: WorkerContext) -> None:
        """A process group is new (the first, or one formed in place)."""

    def start(self, core: Any) -> None:
        """`Run.start` restored the state; `core` (elastic._worker.run.core.RunCore) is the run's shared state."""

    def loop_started(self, step: int, *, resizable: bool) -> None:
        """A `run.batches` loop starts at `step`; `resizable`: its loader follows the sampler's shares."""

    def before_step(self, step: int) -> None:
        """Step `step + 1` is about to be trained on this rank."""

    def body_ended(self, step: int) -> Change:
        """The script's body of step `step + 1` is done, the step not counted yet: NONE, or VOID."""
        return Change.NONE

    def step_ended(self, step: int) -> Change:
        """The script's body of step `step` is done (its update made), before the vote: NONE, or REWIND."""
        return Change.NONE

    def ballot_size(self, world_size: int) -> int:
        return 0

    def ballot(self) -> Sequence[int]:
        return ()

    def after_step(self, step: int, ballots: tuple[int, ...] | None) -> Change:
        return Change.NONE

    def step_done(self, step: int) -> Change:
        """Step `step`'s bookkeeping is done (its vote acted on, its saves started): NONE, RESHARD or STOP."""
        return Change.NONE

    def collective_failed(self, why: str) -> Change | None:
        """A collective of the step's bookkeeping failed (`why`): None when this part does not heal it (the
        error stands), else the change the heal made (RESHARD: this rank's place changed)."""
        return None

    def finish(self) -> None:
        """`Run.finish`, before the final save."""


class Parts:
    """A run's loop parts, in order: every hook fanned out, their ballots laid end to end on the vote."""

    def __init__(self, members: Iterable[LoopPart] = ()) -> None:
        self.members: list[LoopPart] = list(members)
        self._sizes: list[int] = []

    def add(self, part: LoopPart) -> None:
        self.members.append(part)

    def on_group(self, ctx: WorkerContext) -> None:
        self._sizes = [max(0, int(part.ballot_size(ctx.world_size))) for part in self.members]
        for part in self.members:
            part.on_group(ctx)

    def start(self, core: Any) -> None:
        for part in self.members:
            part.start(core)

    def loop_started(self, step: int, *, resizable: bool) -> None:
        for part in self.members:
            part.loop_started(step, resizable=resizable)

    def before_step(self, step: int) -> None:
        for part in self.members:
            part.before_step(step)

    def body_ended(self, step: int) -> Change:
        """Every part's answer to a step's body; the first VOID stops the round there (the step did not happen)."""
        for part in self.members:
            change = part.body_ended(step) or Change.NONE
            if change.kind is Kind.VOID:
                return change
        return Change.NONE

    def step_ended(self, step: int) -> Change:
        """Every part's answer before the vote; a REWIND stops the round there (the parts after it do
        not see a step that every rank went back from)."""
        for part in self.members:
            change = part.step_ended(step) or Change.NONE  # (a part that returns nothing asks nothing)
            if change.kind is Kind.REWIND:
                return change
        return Change.NONE

    def ballots(self) -> list[int]:
        """Every part's ballot, each padded with zeros or cut to its declared size."""
        laid: list[int] = []
        for part, size in zip(self.members, self._sizes):
            if size:
                own = [int(v) for v in list(part.ballot())[:size]]
                laid += own + [0] * (size - len(own))
        return laid

    def after_step(self, step: int, laid: tuple[int, ...]) -> Change:
        """Each part's slice of the vote's verdict (empty for a part of size 0); None to all off a vote step
        (`laid` does not fit the sizes)."""
        fits = bool(laid) and len(laid) == sum(self._sizes)
        change, at = Change.NONE, 0
        for part, size in zip(self.members, self._sizes):
            mine = laid[at:at + size] if fits else None
            at += size
            change = change | (part.after_step(step, mine) or Change.NONE)
        return change

    def step_done(self, step: int) -> Change:
        change = Change.NONE
        for part in self.members:
            change = change | (part.step_done(step) or Change.NONE)
        return change

    def collective_failed(self, why: str) -> Change | None:
        """The first answer of a part that heals the failure (None: no part does)."""
        for part in self.members:
            change = part.collective_failed(why)
            if change is not None:
                return change
        return None

    def finish(self) -> None:
        for part in self.members:
            part.finish()
