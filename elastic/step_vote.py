"""The vote every step ends with, started before the step ends so the loop does not wait for it.

At the end of every step the ranks must agree on three things: whether any
rank was preempted (SIGTERM: commit this step and leave), whether rank 0's
checkpoint saves keep failing (stop with exit 75), and how many steps apart
the in-memory snapshots are from now on. That is one collective, an
element-wise MAX of three ints on the gloo control group; taken blocking at
the step's end it puts a host round trip on every step's critical path.

So it is started when the step's optimizer step begins (an optimizer
pre-hook, `start`) and read when the step ends (`result`): the round trip
runs under the optimizer and scheduler steps.

    vote = StepVote(ctx, ballot=lambda: (signalled, storage_failing, snapshot_every_proposal))
    optimizer.register_step_pre_hook(lambda *_: vote.start())
    for each step:
        vote.open_step(); ...forward, backward, optimizer.step()...
        verdict = vote.result()      # every rank: the same Verdict, acted on at this step

Invariants:
- Every rank issues exactly one vote per step, before that step's end: at its
  optimizer step, or, when none ran in the step (gradient accumulation, a
  step the grad scaler skipped), at the step's end, blocking. Either way it is
  the same single collective in the same place of every rank's sequence on
  the control group, so every rank reads the same verdict at the same step.
- A flag raised after this step's vote started (a SIGTERM during the optimizer
  step) is carried by the next step's vote: one step later, which is why the
  SIGTERM grace must hold two steps, not one.
- `fresh` (between steps: `Run.pause`) reads any vote in flight and takes a
  new, blocking one, and merges them: a flag raised during the pause counts.
- No vote is started outside an open step (an optimizer step before the loop
  or after a `break`): there would be no step end to read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from elastic import agreement
from elastic.runtime import WorkerContext

Ballot = Callable[[], tuple[bool, bool, int]]
"""This rank's (preempted, storage failing, proposed snapshot interval; 0: no opinion)."""


@dataclass(frozen=True)
class Verdict:
    """What every rank acts on at the end of a step."""

    preempted: bool
    """Some rank received SIGTERM."""
    storage_failing: bool
    """Rank 0's periodic saves failed `ckpt_max_failures` times in a row."""
    snapshot_every: int
    """The largest interval any rank proposed (0: no rank takes snapshots)."""

    @classmethod
    def of(cls, values: list[int]) -> Verdict:
        preempted, storage_failing, snapshot_every = values
        return cls(bool(preempted), bool(storage_failing), int(snapshot_every))


class StepVote:
    """One rank's side of the per-step vote (see the module docstring)."""

    def __init__(self, ctx: WorkerContext, ballot: Ballot) -> None:
        self._ctx = ctx
        self._ballot = ballot
        self._pending: agreement.PendingMax | None = None
        self._open = False
        self.early = self.late = 0
        """Votes started at an optimizer step / at a step's end (blocking): how often the round trip hid."""

    def _cast(self) -> agreement.PendingMax:
        preempted, storage_failing, snapshot_every = self._ballot()
        return agreement.start_max(self._ctx, [int(preempted), int(storage_failing), int(snapshot_every)])

    def open_step(self) -> None:
        """A step begins: an optimizer step from now until `result` may start its vote."""
        self._open = True

    def start(self) -> None:
        """Optimizer pre-hook: start this step's vote (once a step, inside an open step only)."""
        if self._open and self._pending is None:
            self._pending = self._cast()
            self.early += 1

    def result(self) -> Verdict:
        """The step ends: this step's verdict (the vote started at its optimizer step, else one now)."""
        self._open = False
        pending, self._pending = self._pending, None
        if pending is None:
            pending = self._cast()
            self.late += 1
        return Verdict.of(pending.result())

    def fresh(self) -> Verdict:
        """Between steps: a vote taken now, merged with any still in flight (read first)."""
        earlier = self.settle()
        now = Verdict.of(self._cast().result())
        if earlier is None:
            return now
        return Verdict(
            earlier.preempted or now.preempted, earlier.storage_failing or now.storage_failing, now.snapshot_every
        )

    def settle(self) -> Verdict | None:
        """Read a vote still in flight (a `break` after the optimizer step left one); None if there is none."""
        self._open = False
        pending, self._pending = self._pending, None
        return None if pending is None else Verdict.of(pending.result())

    def drop(self) -> None:
        """Leaving on an error: forget a vote in flight without waiting on peers that may be gone."""
        self._open = False
        self._pending = None
