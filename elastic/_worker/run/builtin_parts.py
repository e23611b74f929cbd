"""The runtime's own loop parts (elastic._worker.run.parts): `--slow-ranks` and the integrity checks.

Each adapts a part of a lower layer (elastic._worker.observe.slow_ranks, elastic._worker.integrity) to
the loop's hooks, so the loop calls them as it calls a script's own parts, and neither knows the loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from elastic._worker.integrity.loop_part import Integrity
from elastic._worker.observe.slow_ranks import SlowRanks, can_leave
from elastic._worker.run.parts import Change, LoopPartBase
from elastic._worker.runtime.context import WorkerContext


class SlowRanksPart(LoopPartBase):
    """`--slow-ranks`: its clock runs from a step's start to its body's end, its figures ride on the
    vote (a slot per rank), and a verdict that changes the shares reshards."""

    def __init__(self, slow: SlowRanks, survivors: Any) -> None:
        self.slow, self.survivors = slow, survivors
        self._world_size = 1

    def on_group(self, ctx: WorkerContext) -> None:
        self._world_size = ctx.world_size
        self.slow.on_new_group(ctx)

    def before_step(self, step: int) -> None:
        self.slow.step_started()

    def step_ended(self, step: int) -> Change:
        self.slow.step_ended()
        return Change.NONE

    def ballot_size(self, world_size: int) -> int:
        return world_size if self.slow.enabled else 0

    def ballot(self) -> Sequence[int]:
        return self.slow.figures() or ()

    def after_step(self, step: int, ballots: tuple[int, ...] | None) -> Change:
        if ballots is None:
            return Change.NONE
        shares_changed = self.slow.verdict(ballots, step, can_leave=can_leave(self.survivors, self._world_size))
        return Change.RESHARD if shares_changed else Change.NONE


class IntegrityPart(LoopPartBase):
    """Replica checks and the numeric guard (elastic._worker.integrity.loop_part): armed before each step,
    checked at each step's end before the vote (a step is saved only once its check passed), and a
    rollback every rank agreed on answered as REWIND. `core` gives the current group's context and
    checkpoint manager (the check settles saves in flight, and runs first at a step a save is due)."""

    def __init__(self, integrity: Integrity) -> None:
        self.integrity = integrity
        self._core: Any = None

    def start(self, core: Any) -> None:
        self._core = core

    def loop_started(self, step: int, *, resizable: bool) -> None:
        self.integrity.loop_started(step, rotatable=resizable)  # a batch's blocks can move across ranks

    def before_step(self, step: int) -> None:
        self.integrity.step_starting(step)

    def step_ended(self, step: int) -> Change:
        core = self._core
        checkpoints = core.group_parts.checkpoints
        with core.step_costs.timing("integrity"):
            back_to = self.integrity.step_ended(step, core.context, checkpoints.flush, checkpoints.due)
        return Change.NONE if back_to is None else Change.rewind(back_to)
