"""The vote steps end with: about once a second, and read one vote later, so the loop never waits for it.

At the end of a step the ranks must agree on what to do: stop because some
rank was preempted (SIGTERM: commit and leave), stop because rank 0's
checkpoint saves keep failing (exit 75), change the in-memory snapshot
interval. That is one collective, an element-wise MAX of a few ints on the
gloo control group. Taken blocking at every step it costs every step a round
trip through gloo's threads: on a busy 2-core host 0.3 ms at the median and
1.3 ms on average, waiting for cores (benchmarks/control_cost.py), 0.4 % of
the GPT recipe's step.

So a vote is started at the end of a step and read at the end of the next
vote step, and vote steps are `every` steps apart: the number of steps in
about `VOTE_SECONDS` (at most `MAX_EVERY`, and few enough that a signal's
two votes fit in a quarter of `--term-grace`). The ranks agree on `every`
through the vote itself. `every` at most doubles per vote (1, 2, 4, 8, 10):
what a loop measures in its first steps (the first snapshot's cost, which
sets the snapshot interval) is agreed a few steps later, not a second's
worth of steps later.

    vote = StepVote(ctx, ballot=lambda: Ballot(preempted=signalled, snapshot_every=proposal), grace=15.0)
    for each step:
        ...forward, backward, optimizer.step()...
        verdict = vote.step_ended(step)     # every rank: the same Verdict at the same step

Invariants:
- Every rank reads the same verdict at the same step: the vote steps follow
  from the loop's first step end and the agreed `every` alone, the same on
  every rank; each starts one vote per vote step, in the same place of its
  sequence of collectives on the control group, and reads it at the next vote
  step (or at `fresh`, `settle`).
- A flag raised during step N is acted on by every rank within two vote
  intervals: at most 2 x `MAX_EVERY` steps and about 2 x `VOTE_SECONDS`
  later, always within a quarter of `--term-grace` at the measured step time
  (at once when the job has one process: no peer to wait for).
- The first step end of a loop, and the first after `fresh`, is a vote step
  that reads no vote: none was in flight, on any rank alike.
- `fresh` (between steps: `Run.pause`) reads the vote in flight and takes a
  new, blocking one, and merges them: a flag raised during the pause counts.
- With `slots` the vote also carries the loop parts' ballots (elastic._worker.run.parts), laid end to
  end, as long on every rank: each element MAX-reduced (`Verdict.slots`). `--slow-ranks` puts one slot
  per rank there, each rank's own figure in its slot and 0 in the others': the MAX hands every rank
  every rank's figure; with train-on the survivors' part puts rank 0's reading of the newest ticket of
  a worker waiting to join in its slot. They ride on the collective the vote takes anyway. The parts
  read their slots at step ends only: the slots of a vote `fresh` read (between steps) are handed to
  them at the next step end, a vote step (with a pause between every two steps, `fresh` reads every vote).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from elastic._worker.control import agreement, collective_record
from elastic._worker.control.collective_record import CollectiveRecord
from elastic._worker.runtime.context import WorkerContext
from elastic._worker.timings import VOTE_SECONDS


@dataclass(frozen=True)
class Ballot:
    """This rank's vote at a step's end (every field MAX-reduced over the ranks)."""

    preempted: bool = False
    """This rank received SIGTERM or the Slurm requeue signal."""
    requeue: bool = False
    """... the Slurm requeue signal."""
    storage_failing: bool = False
    """Rank 0's saves failed `ckpt_max_failures` times in a row."""
    snapshot_every: int = 0
    """The snapshot interval this rank proposes (0: no opinion)."""


Caster = Callable[[], Ballot]

STOP_BALLOT = 1
"""A preempted rank's vote: commit and leave."""
REQUEUE_BALLOT = 2
"""One preempted by the Slurm requeue signal: commit, leave and requeue (the vote's MAX: one rank is enough)."""
MAX_EVERY = 10
_WINDOW = 16  # recent steps the step time is measured on


@dataclass(frozen=True)
class Verdict:
    """What every rank acts on at the end of a step."""

    preempted: bool = False
    """Some rank received SIGTERM (or the Slurm requeue signal)."""
    requeue: bool = False
    """Some rank received the Slurm requeue signal: after the commit, the job requeues itself."""
    storage_failing: bool = False
    """Rank 0's periodic saves failed `ckpt_max_failures` times in a row."""
    snapshot_every: int = 0
    """The largest snapshot interval any rank proposed (0: no change)."""
    vote_every: int = 0
    """Steps between votes from now on (0: no change)."""
    slots: tuple[int, ...] = ()
    """The loop parts' ballots, each element the MAX over the ranks (`slots`; empty without them)."""

    @classmethod
    def of(cls, values: list[int]) -> Verdict:
        preempted, storage_failing, snapshot_every, vote_every = values[:4]
        return cls(preempted=bool(preempted), requeue=preempted >= REQUEUE_BALLOT,
                   storage_failing=bool(storage_failing), snapshot_every=int(snapshot_every),
                   vote_every=int(vote_every), slots=tuple(int(v) for v in values[4:]))


NOTHING = Verdict()


class StepVote:
    """One rank's side of the vote (see the module docstring)."""

    def __init__(
        self, ctx: WorkerContext, ballot: Caster, *, grace: float, clock=time.monotonic,
        group: Any = agreement.DEFAULT_GROUP,
        record: CollectiveRecord | None = None, slots: Callable[[], list[int] | None] | None = None,
    ) -> None:
        """`group`: the ranks' group for the vote (default: the runtime's control group); `record`: this
        rank's record of collectives, where each wait for a vote's result is an entry (hang naming; default:
        this process's, `collective_record.of_this_process`); `slots`: the parts' ballots, as long on every
        rank (None or empty: none)."""
        self._record = record if record is not None else collective_record.of_this_process()
        self._step = 0  # the step the newest vote was read at
        self._ctx = ctx
        self._group = group
        self._ballot = ballot
        self._slots = slots
        self._grace = grace
        self._clock = clock
        self._pending: agreement.PendingMax | None = None
        self.every = 1
        """Steps between vote steps, as agreed."""
        self._next: int | None = None  # the next vote step; None: the next step end
        self._last_end: float | None = None
        self._step_seconds: deque[float] = deque(maxlen=_WINDOW)
        self.votes = 0
        self._carried: tuple[int, ...] = ()  # the slots `fresh` read, handed to the parts at the next step end

    def proposal(self) -> int:
        """This rank's ballot for `every`: about VOTE_SECONDS of steps, within the bounds, at most twice
        the agreed `every`."""
        if not self._step_seconds:
            return 1
        step = statistics.median(self._step_seconds)
        if step <= 0:
            return MAX_EVERY
        within_grace = int(self._grace / 4 / (2 * step))  # a signal's two votes in a quarter of the grace
        return max(1, min(round(VOTE_SECONDS / step), MAX_EVERY, within_grace, 2 * self.every))

    def _cast(self) -> agreement.PendingMax:
        ballot = self._ballot()
        preemption = (REQUEUE_BALLOT if ballot.requeue else STOP_BALLOT) if ballot.preempted else 0
        self.votes += 1
        slots = (self._slots() if self._slots is not None else None) or []
        return agreement.start_max(
            self._ctx, [preemption, int(ballot.storage_failing), int(ballot.snapshot_every), self.proposal(), *slots],
            self._group,
        )

    def step_ended(self, step: int) -> Verdict:
        """Step `step` ended: on a vote step, the verdict of the vote before, and a new vote starts."""
        now = self._clock()
        self._step = step
        if self._last_end is not None:
            self._step_seconds.append(now - self._last_end)
        self._last_end = now
        if not self._ctx.distributed:
            return Verdict.of(self._cast().result())  # alone: the answer is this process's own, at once (no wait)
        if self._next is not None and step < self._next:
            return NOTHING
        earlier = self.settle() or NOTHING
        if not earlier.slots and self._carried:  # `fresh` read the vote of this step end: its slots, now
            earlier = replace(earlier, slots=self._carried)
        self._carried = ()
        if earlier.vote_every:
            self.every = earlier.vote_every
        self._pending = self._cast()
        self._next = step + self.every
        return earlier

    def votes_at(self, step: int) -> bool:
        """Whether the end of `step` is a vote step here (it reads the vote in flight and casts the next)."""
        return self._ctx.distributed and (self._next is None or step >= self._next)

    def rewound(self) -> None:
        """Every rank went back to an earlier step (a rollback, elastic._worker.integrity): the next step
        end is a vote step, so the steps replayed keep the vote's rhythm (its steps follow the step count)."""
        self._next = None

    def fresh(self) -> Verdict:
        """Between steps: a vote taken now, merged with the one in flight (read first); the next
        step end is a vote step."""
        earlier = self.settle() or NOTHING
        now = Verdict.of(self._wait(self._cast()))
        self._next = None
        self.every = now.vote_every
        self._carried = now.slots or earlier.slots  # the parts read theirs at the next step end (a vote step)
        return Verdict(
            preempted=earlier.preempted or now.preempted, requeue=earlier.requeue or now.requeue,
            storage_failing=earlier.storage_failing or now.storage_failing,
            snapshot_every=now.snapshot_every or earlier.snapshot_every, vote_every=now.vote_every,
        )

    def settle(self) -> Verdict | None:
        """Read the vote in flight (None if there is none): at `finish`, before the final save."""
        pending, self._pending = self._pending, None
        return None if pending is None else Verdict.of(self._wait(pending))

    def _wait(self, pending: agreement.PendingMax) -> list[int]:
        """A vote's result, its wait an entry of this rank's record of collectives."""
        if self._record is None:
            return pending.result()
        seq = self._record.enter("step vote", self._step)
        result = pending.result()
        self._record.leave(seq)
        return result
