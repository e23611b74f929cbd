"""How the members of a newly formed group learn where to carry on from (`agree`).

The state itself is not sent here: the checkpoint package's live restore
(`CheckpointManager.restore_live`, elastic._worker.checkpoint.live_source) takes it
from the member `agree` names, so a replacement, and a rank one step behind, hold
the newest state instead of recomputing it. A script on the raw pieces sends it
its own way (tests/heal_worker.py broadcasts it over the new group).

Invariants:
- `agree` is the first collective of a new group: every member gives the
  number of steps it completed, and learns the fewest and the most. A rank may
  be one step ahead of another (the dead peer's contribution reached it and not
  the other), never more: a step needs every rank's gradients.
- Every member learns the same `Agreement`; its `source` is a member that completed `most` steps.
- A collective that fails here is a `GroupBroken` (one line): the heal starts over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic._shared.common.errors import first_line as _first_line
from elastic._worker.survivors.regroup import GroupBroken


@dataclass(frozen=True)
class Agreement:
    """What the members of a new group learned of each other's progress."""

    fewest: int
    """The fewest steps a member completed (a replacement counts what it restored: maybe 0)."""
    most: int
    """The most steps a member completed: where the group carries on from."""
    source: int
    """The lowest rank that completed `most` steps: the others take its state (`CheckpointManager.restore_live`)."""


def agree(completed: int, group: Any = None) -> Agreement:
    """Every member's completed steps, combined in one collective (the first of a new group) on `group`
    (None: the default group)."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if group is None else (group.rank(), group.size())
    votes = ballot(completed, rank=rank, world_size=world_size)
    try:
        if group is None:
            dist.all_reduce(votes, op=dist.ReduceOp.MAX)
        else:  # (a group of its own: a test's rank as a thread, which has no default group)
            options = dist.AllreduceOptions()
            options.reduceOp = dist.ReduceOp.MAX
            group.allreduce([votes], options).wait()
    except RuntimeError as error:
        raise GroupBroken(f"the new group broke while its members compared steps: {_first_line(error)}") from None
    return count(votes, world_size=world_size)


def ballot(completed: int, *, rank: int, world_size: int) -> torch.Tensor:
    """One member's vote; the element-wise MAX of all votes is read by `count`. The largest
    `completed * world_size + (world_size - 1 - rank)` names the most steps and, among the
    members that completed them, the lowest rank; the largest `-completed` the fewest steps."""
    return torch.tensor([-completed, completed * world_size + (world_size - 1 - rank)], dtype=torch.int64)


def count(votes: torch.Tensor, *, world_size: int) -> Agreement:
    most, lowest = divmod(int(votes[1]), world_size)
    return Agreement(fewest=-int(votes[0]), most=most, source=world_size - 1 - lowest)
