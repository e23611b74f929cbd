"""The parts of a `Run` that meet on one process group: the step vote and the checkpoint manager.

Both hold the group's connections (the vote keeps a collective in flight; a
save in flight meets its writers in collectives), so they live and die with
the group: `GroupParts.build` makes them on a new group (the first, or one the
survivors formed in place), taking over from the checkpoint manager before,
and `drop` lets go of a group about to be left.

Invariant: the parts of a group are used only on that group; after `drop`,
the vote is an inert one on the same context (its `fresh()` answers without a
collective) until the next `build`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from elastic._shared.protocol.fault_hook import FaultHook
from elastic._worker.checkpoint import CheckpointManager
from elastic._worker.config import RunConfig
from elastic._worker.control.step_vote import Caster, StepVote
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.integrity.loop_part import Integrity
from elastic._worker.observe.events import EventLog
from elastic._worker.runtime.context import WorkerContext


@dataclass(frozen=True)
class RegisteredState:
    """What the checkpoint manager saves and restores, registered once by `Run.start`."""

    model: Any
    optimizer: Any
    sampler: ElasticSampler
    scheduler: Any
    scaler: Any
    extra: Mapping[str, Any] | None


@dataclass
class GroupParts:
    """The step vote and the checkpoint manager of one group (see the module docstring)."""

    ctx: WorkerContext
    vote: StepVote
    checkpoints: CheckpointManager

    @classmethod
    def build(
        cls,
        ctx: WorkerContext,
        config: RunConfig,
        state: RegisteredState,
        *,
        ballot: Caster,
        events: EventLog,
        faults: FaultHook,
        earlier: CheckpointManager | None,
        slots: Callable[[], list[int]] | None = None,
        integrity: Integrity | None = None,
    ) -> GroupParts:
        """`slots`: the loop parts' ballots, which ride on the vote (elastic._worker.run.parts).
        `integrity`: the replica checks, told of a group that took over from `earlier` (formed in place)."""
        if integrity is not None and earlier is not None:
            integrity.regrouped()
        vote = StepVote(ctx, ballot, grace=config.term_grace, slots=slots)
        checkpoints = CheckpointManager(
            ctx, config, model=state.model, optimizer=state.optimizer, sampler=state.sampler,
            scheduler=state.scheduler, scaler=state.scaler, extra=state.extra, events=events, faults=faults,
        )
        if earlier is not None:
            checkpoints.take_over(earlier)
        return cls(ctx, vote, checkpoints)

    def drop(self, ballot: Caster, config: RunConfig) -> None:
        """Before leaving the group: saves in flight met on it (abandoned), and a vote in flight holds
        its connections open (a peer waiting in it would wait its whole timeout, not fail at once)."""
        self.checkpoints.close(wait=0.0)
        self.vote = StepVote(self.ctx, ballot, grace=config.term_grace)
