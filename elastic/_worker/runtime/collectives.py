"""The collectives a script calls between steps (`elastic.all_reduce_mean`), and what a peer's death does to them.

Work between steps (an evaluation, sampling) runs inside `Run.pause()`, and its collectives run on the
training's group. When a peer dies there and the survivors heal in place (--survivors keep or train-on),
the collective fails on every rank still in it. Raised into the script, that error ended the survivor
too: the heal then found no member holding any state, and a new round restored the job (steps redone).

So, inside a pause whose run can heal (`pause_collectives(tolerant=True)`), a collective that fails is
*skipped*: `all_reduce_mean` returns this rank's own value, as if the rank were alone, and so do the
pause's collectives after it (the group is broken: none of them may wait on it), the step vote's
between-steps vote included (`PauseCollectives.call`). The pause records why
(`PauseCollectives.broken`). Where the pause came before the update of the step whose batch the script
holds (an evaluation at the top of the loop's body), `Run.pause()` makes that step void, so it heals the
group and is trained again with the data of the healed group, as a step whose gradient all-reduce
failed is; `Run.due` is false at a step trained again, so the evaluation that broke is not run twice,
on the survivors or on a replacement (whose pause would otherwise wait in a collective the others never
enter). Where the update was made already, voiding the step would apply it twice: the step completes,
and the next collective (the vote, or the next step's all-reduce) meets the broken group and heals it.

Not covered, as before: a script's own `dist.all_reduce` in a pause raises and ends the worker; so does
a forward that makes collectives on the broken group (SyncBatchNorm, DDP's buffer broadcast); a pause
after the last step leaves `finish` to meet the broken group. A skipped evaluation's value is this
rank's alone: a script that decides on it (early stopping) may decide differently on each rank.

Invariants: outside a pause, or in one that cannot heal, a failed collective raises as `torch.distributed`
does; a skipped collective never returns a partly reduced tensor (it returns a fresh copy of the input).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from elastic._shared.common.errors import first_line

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class PauseCollectives:
    """The collectives of one pause."""

    tolerant: bool
    """The run heals in place: a failed collective is skipped, not raised."""
    broken: str | None = None
    """The first failed collective's message (None: none failed)."""

    def call(self, collective: Callable[[], T]) -> T | None:
        """`collective()`'s result; None when it failed and was skipped, or the group broke before (then it
        is not called: nothing may wait on the broken group)."""
        if self.broken is not None:
            return None
        try:
            return collective()
        except RuntimeError as error:
            if not self.tolerant:
                raise
            self.broken = first_line(error)
            rank = dist.get_rank() if dist.is_initialized() else 0
            logger.warning("rank %d: a collective between steps failed (%s): this rank goes on alone until the "
                           "next step, which heals the group", rank, self.broken)
            return None


_current: PauseCollectives | None = None


@contextmanager
def pause_collectives(*, tolerant: bool) -> Iterator[PauseCollectives]:
    """The collectives of the block are a pause's (see the module docstring)."""
    global _current
    outer, _current = _current, PauseCollectives(tolerant)
    try:
        yield _current
    finally:
        _current = outer


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    """`elastic.all_reduce_mean`: the mean of `value` over the job's current group (the default one,
    also after the survivors rebuilt it in place); a collective. A new tensor; alone, a copy (and in a
    pause whose group broke: see the module docstring)."""
    out = value.detach().clone()
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return out

    def reduce() -> bool:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return True

    pause = _current
    if not (reduce() if pause is None else pause.call(reduce)):
        return value.detach().clone()  # skipped (see the module docstring): never a partly reduced tensor
    out /= dist.get_world_size()
    return out
