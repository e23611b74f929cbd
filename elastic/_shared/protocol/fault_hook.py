"""Named points on the step, save and restore paths where a fault may be injected, and the hook that fills them.

    faults = fault_hook.for_worker(ctx.rank, ctx.restart_count, ctx.env.variables)
    faults.at("before_commit", step)           # nothing happens, unless a fault plugin fills the hook

The library only marks the points. A fault plugin fills them: in a worker
whose environment sets ELASTIC_FAULT, `for_worker` loads the plugin registered
under the entry point group `torchrevive.faults` (the chaos tooling registers
`elastic.chaos.faults:FaultInjector`, which reads ELASTIC_FAULT). So the
library never imports the chaos tooling, and a production run without
ELASTIC_FAULT runs no fault code at all.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from importlib.metadata import entry_points
from typing import Protocol

from elastic._shared.common.errors import UsageError

POINTS = (
    "during_write", "before_commit", "after_step", "before_read", "during_read", "during_snapshot",
    "during_catch_up", "during_all_reduce", "during_vote", "during_replica_check", "during_heal",
    "snapshot_begun", "snapshot_checksummed", "snapshot_committed", "during_pause",
)
"""Where faults can fire: writing a checkpoint (after its first item), just before its commit, after
a step, a restore's read of a step (before any of its bytes: every rank has agreed on the step and
learned where its parts are; and after its first chunk), writing an in-memory snapshot (its phases,
elastic._worker.checkpoint.snapshot_write: its slot's header removed, nothing copied; data written,
no checksums; checksums made, header not written; header written, no replica yet), taking the state
from a live peer in a heal in place (a member that takes it: the header received, no tensor), a
step's gradient all-reduce (its first bucket, before it is sent; the step is the one being trained:
heals in place only, whose comm hook marks it), a vote step of the step vote (before the vote in
flight is read and the next one cast), a replica check (before its exchange), a survivor's heal
in place (its broken group left, the next one not formed yet), and the start of work between steps
(`Run.pause`, at the step last completed: an evaluation's collectives then wait on the dead rank)."""
ENV_VAR = "ELASTIC_FAULT"
ENTRY_POINT_GROUP = "torchrevive.faults"


TAMPERING = ("flip", "nan")
"""Faults that change numbers, not processes: the plugin says whether one is due (`tamper`), the worker makes it
(elastic._worker.integrity.tamper): `flip` one bit of one parameter after the step's update, `nan` the loss
of the step."""


class FaultHook(Protocol):
    def at(self, point: str, step: int) -> None:
        """Reached `point` (one of `POINTS`) at `step`: fire whatever fault is meant for here."""
        ...


def tampering(hook: FaultHook, point: str, step: int, action: str, samples: Collection[int] = ()) -> bool:
    """Whether the tampering `action` (one of `TAMPERING`) is due at `point` and `step` (it counts as
    fired); `samples`: the sample indices this rank trains in the step (a fault may follow a sample).
    A hook without a `tamper` method (one that only kills) tampers with nothing."""
    tamper = getattr(hook, "tamper", None)
    if tamper is None:
        return False
    return bool(tamper(point, step, action, samples) if samples else tamper(point, step, action))


class NoFaults:
    """The hook when no fault is asked for: every point is a no-op."""

    def at(self, point: str, step: int) -> None:
        pass

    def tamper(self, point: str, step: int, action: str, samples: Collection[int] = ()) -> bool:
        return False


NO_FAULTS = NoFaults()


def for_worker(rank: int, restart: int, environ: Mapping[str, str]) -> FaultHook:
    """This worker's faults: none without ELASTIC_FAULT; else the installed fault plugin's, which
    is called as `plugin(rank, restart, environ)`. One `UsageError` line when none is installed."""
    env = environ
    if not env.get(ENV_VAR):
        return NO_FAULTS
    plugins = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda p: p.name)
    if not plugins:
        raise UsageError(
            f"{ENV_VAR} is set, but no fault plugin is installed (entry point group {ENTRY_POINT_GROUP}); "
            "install torchrevive with pip, whose chaos tooling is one, or unset it"
        )
    return plugins[0].load()(rank, restart, dict(env))
