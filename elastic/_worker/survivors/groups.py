"""Where a survivor's process groups live: the seam between the heals and torch's process-global group.

A worker heals by leaving its group and forming the next one in the same process; in a job that group
is torch's default group (`ProcessGroups`, the one instance `PROCESS`). The heals (healing.py, regroup.py,
catch_up.py) reach it only through a `Groups`, so that ranks run as threads of one test process
(tests/thread_ranks.py) drive the same heals, each on a group of its own, where one process can hold
only one default group.

Invariant: `form` is called only once `require_left` passed (the last group is gone); `group` is what
the collectives of a heal run on (None: the default group).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

from elastic._worker.runtime.context import shutdown_worker, teardown_pending


class NotLeft(Exception):
    """The last group could not be left in time (regroup turns it into its `RegroupError`)."""


class Groups(Protocol):
    """A survivor's current process group (see the module docstring)."""

    @property
    def group(self) -> Any: ...

    def form(self, store: dist.Store, *, rank: int, world_size: int, timeout: timedelta,
             form_within: timedelta | None = None) -> None: ...

    def leave(self, model: Any = None) -> None: ...

    def require_left(self, purpose: str) -> None: ...

    def formed(self) -> bool: ...


class ProcessGroups:
    """torch's default group of this process (a worker's): `form` is `init_process_group`."""

    group = None

    def form(self, store: dist.Store, *, rank: int, world_size: int, timeout: timedelta,
             form_within: timedelta | None = None) -> None:
        """The default group on `store`; `form_within`: a shorter bound for the forming alone, after which
        collectives get `timeout`."""
        try:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=min(timeout, form_within) if form_within is not None else timeout)
        except BaseException:
            if not dist.is_initialized():
                # torch named the group by its counter ("0": its keys' prefix) before the forming failed, and
                # puts the counter back only in destroy_process_group, which needs a group: the next try
                # must name its group "0" again, as a new process (a replacement) does, or they never meet.
                dist.distributed_c10d._world.group_count = 0
            raise
        if form_within is not None:
            _set_timeout(timeout)

    def leave(self, model: Any = None) -> None:
        """Let go of the broken group now: drop DDP's hold on it (`model`'s reducer, its logger, its
        group) and tear the default group down without waiting on a peer.

        Why at once, before waiting for the heal: a ring all-reduce's rank learns of a death only from
        its neighbours, so a rank that is not next to the dead one waits in the collective until a
        neighbour's sockets close, which happens only when the last hold on that neighbour's group is
        gone; otherwise it waits the whole collective timeout. ddp_rebind builds the reducer again."""
        if model is not None:
            model.reducer = None
            model.logger = None
            model.process_group = None
        if dist.is_initialized():
            shutdown_worker(failed=True)

    def require_left(self, purpose: str) -> None:
        """`RegroupError` unless the last group is gone: left, and its teardown ended (one that overran
        its deadline still holds the group's sockets open, and a peer blocked on them: see
        `runtime.teardown_pending`; only this worker's exit closes them)."""
        if dist.is_initialized() or teardown_pending():
            raise NotLeft(f"the broken process group could not be left in time for {purpose} "
                          "(a collective of it still waits on a peer); leaving so that its sockets close")

    def formed(self) -> bool:
        return dist.is_initialized()


PROCESS = ProcessGroups()


def _set_timeout(timeout: timedelta) -> None:
    """The default group's collective timeout from now on (torch >= 2.2; older ones keep the first)."""
    setter = getattr(dist, "set_timeout", None) or getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is not None:
        setter(timeout)
