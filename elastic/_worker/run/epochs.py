"""Epochs as a unit of a run: where `run.batches` stops, and the epoch form with its end-of-epoch point.

    for x, y in run.batches(loader, max_epochs=args.epochs): ...     # the steps of args.epochs epochs

    for epoch in run.epochs(args.epochs):          # the epoch form: the epoch the next step starts in
        for x, y in run.batches(loader):           # that epoch's steps
            ...
        evaluate(model, test_set)                  # the end of the epoch: as inside `with run.pause():`

Invariants:
- An epoch's steps are the steps that start in it (the elastic sampler's epoch before the step): a
  global batch that reaches into the next epoch's first samples belongs to the epoch it starts in.
  Where a loop stops depends on the sampler's position alone (`StepLimit.done`), never on a count
  of steps worked out at the start, so it holds after a resize, a restore at another world size or
  a group changed in place.
- `max_epochs=E` ends the steps when the position reaches epoch E; with `max_steps` too, whichever
  comes first. Outside `epochs`, `run.batches` needs one of them (`UsageError`, one line).
- The end of an epoch runs as a `run.pause()` block: from the end of the epoch's `run.batches` to
  the next epoch's start (or the end of the `epochs` loop) the watchdog does not count, a SIGTERM
  waits for it, and every random stream the checkpoint carries is forked and put back
  (elastic._worker.runtime.rng.isolated). Work there never moves the training stream, so a run that
  resumes past it (a kill at the epoch's last step skips it) ends bit-identical all the same. It ends
  with the pause's vote, a collective: every rank runs the same epochs.
- `EpochLoop` is a state machine: OUTSIDE (no `epochs` loop), IN_EPOCH (its steps), AT_EPOCH_END (the
  pause). A loop left by an exception or a `break` leaves the pause without its vote (peers may be
  gone; the run's end votes anyway), putting the random streams back all the same.
"""

from __future__ import annotations

import enum
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import TypeVar

from elastic._shared.common.errors import UsageError
from elastic._worker.data.sampler import ElasticSampler

Batch = TypeVar("Batch")


def epochs_done(sampler: ElasticSampler) -> float:
    """Passes over the data set so far, as a fraction."""
    return sampler.epoch + sampler.state.consumed / sampler.num_samples


def steps_to_epoch(sampler: ElasticSampler, world_size: int, epoch: int) -> int:
    """Steps at `world_size` until the sampler's position reaches the start of `epoch` (0 when it has)."""
    left = epoch * sampler.num_samples - (sampler.epoch * sampler.num_samples + sampler.state.consumed)
    return max(0, math.ceil(left / (sampler.batch_size * world_size)))


@dataclass(frozen=True)
class StepLimit:
    """Where a `run.batches` loop stops (see the module docstring)."""

    max_steps: int | None = None
    max_epochs: int | None = None
    shown_epochs: int | None = None
    """The epochs the progress line counts to (the whole `epochs` loop's, not this epoch's)."""

    def done(self, step: int, sampler: ElasticSampler) -> bool:
        return (self.max_steps is not None and step >= self.max_steps) or (
            self.max_epochs is not None and sampler.epoch >= self.max_epochs)

    def last_step(self, step: int, sampler: ElasticSampler, world_size: int) -> int:
        """The step the run ends at, at this world size (the progress line's total)."""
        epochs = self.shown_epochs if self.shown_epochs is not None else self.max_epochs
        ends = [step + steps_to_epoch(sampler, world_size, epochs)] if epochs is not None else []
        return min([*ends, *([self.max_steps] if self.max_steps is not None else [])], default=step)

    def describe(self) -> str:
        return f"max_steps={self.max_steps}" if self.max_steps is not None else f"epoch {self.max_epochs}"


class State(enum.Enum):
    OUTSIDE = "outside an epochs loop"
    IN_EPOCH = "an epoch's steps"
    AT_EPOCH_END = "an epoch's end"


def _whole(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise UsageError(f"{name}={value!r} must be a whole number, 0 or more")


class EpochLoop:
    """The epoch form of one run (see the module docstring). `pause` makes the run's `pause()` block."""

    def __init__(self, pause: Callable[[], AbstractContextManager[None]]) -> None:
        self._pause = pause
        self.state = State.OUTSIDE
        self.epoch = -1
        """The epoch whose steps or end the loop is in (IN_EPOCH, AT_EPOCH_END)."""
        self._max_epochs = 0
        self._end: ExitStack | None = None

    def limit(self, max_steps: int | None, max_epochs: int | None) -> StepLimit:
        """Where `run.batches(max_steps=, max_epochs=)` stops; inside `epochs`, at the epoch's end too."""
        _whole("max_steps", max_steps)
        _whole("max_epochs", max_epochs)
        if self.state is State.OUTSIDE:
            if max_steps is None and max_epochs is None:
                raise UsageError("run.batches() needs max_steps= or max_epochs= (or runs inside "
                                 "`for epoch in run.epochs(N):`, to the end of each epoch)")
            return StepLimit(max_steps, max_epochs)
        ends = self.epoch + 1 if max_epochs is None else min(max_epochs, self.epoch + 1)
        return StepLimit(max_steps, ends, shown_epochs=self._max_epochs)

    def steps(self, steps: Iterator[Batch]) -> Iterator[Batch]:
        """`run.batches`' steps; inside `epochs`, the epoch's end begins when they ran to the last one."""
        yield from steps
        if self.state is State.IN_EPOCH:  # at the epoch's end, or stopped before it by max_steps (the last one)
            self._end = ExitStack()
            self._end.enter_context(self._pause())
            self.state = State.AT_EPOCH_END

    def epochs(self, sampler: ElasticSampler, max_epochs: int) -> Iterator[int]:
        """`run.epochs(max_epochs)`: each epoch from the sampler's own to `max_epochs - 1` (see the module docstring)."""
        _whole("max_epochs", max_epochs)
        if self.state is not State.OUTSIDE:
            raise UsageError("run.epochs() is already looping: one epochs loop at a time")
        self._max_epochs = max_epochs
        try:
            while sampler.epoch < max_epochs:
                self.epoch, self.state = sampler.epoch, State.IN_EPOCH
                yield self.epoch
                self._leave_end(voted=True)  # the epoch's end is done: its vote, on every rank
                if sampler.epoch == self.epoch:
                    return  # its steps stopped before its end (max_steps): the run's steps are done
        finally:
            self._leave_end(voted=False)
            self.state, self.epoch = State.OUTSIDE, -1

    def _leave_end(self, *, voted: bool) -> None:
        end, self._end = self._end, None
        if end is None:
            return
        if voted:
            end.close()  # the pause's end: streams put back, then its vote (a SIGTERM meanwhile: Preempted)
        else:  # left by an exception or a `break` (GeneratorExit): through the pause's own error path, no vote
            error = sys.exc_info()[1] or GeneratorExit()
            end.__exit__(type(error), error, error.__traceback__)
