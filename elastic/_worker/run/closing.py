"""Work between steps and the end of a run: `Run.pause` and `Run.finish`.

Invariants:
- A pause is not a step: the watchdog does not count it, every random stream the checkpoint carries
  is forked for it, a SIGTERM during it waits for its end, and the vote taken at its end (a
  collective) commits the step when some rank was signalled. A peer's death in its collectives, where
  the run heals in place, heals at the step (elastic._worker.runtime.collectives).
- `finish` reads the last vote, commits the final checkpoint (a SIGTERM meanwhile waits for it),
  checks that every rank holds the same parameters, then logs "end": a collective.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from elastic._shared.common.errors import ElasticError
from elastic._worker.observe.replicas import gather_digests, parameter_digest
from elastic._worker.run.core import RunCore
from elastic._worker.runtime.collectives import pause_collectives
from elastic._worker.runtime.rng import isolated


@contextmanager
def pause(core: RunCore) -> Iterator[None]:
    """`Run.pause` (see the module docstring)."""
    core.flush_report()
    survivors, loop = core.survivors, core.loop
    with pause_collectives(tolerant=survivors is not None and survivors.can_heal) as collectives:
        with core.watchdog.paused(), core.signals.hold(), isolated(core.context.device):
            core.faults.at("during_pause", core.step)
            yield
        verdict = collectives.call(core.group_parts.vote.fresh)  # a SIGTERM meanwhile: commit this step, then leave
    if collectives.broken is not None and survivors is not None:
        if loop.before_update():  # else the update was made: the next collective heals, past this step
            survivors.void_step(collectives.broken)
    elif verdict is not None:
        core.act_on(verdict)


def finish(core: RunCore, **end_fields: Any) -> dict[str, Any]:
    """`Run.finish` (see the module docstring); the run's summary."""
    ctx, loop, model = core.context, core.loop, core.model
    assert model is not None
    if core.finished:
        raise RuntimeError("Run.finish() was already called")
    core.finished = True
    parts = core.group_parts
    loop.flush_report()
    parts.vote.settle()  # the last step's vote: read it (the final save follows whatever it says)
    core.parts.finish()
    core.watchdog.close()  # what follows is not a training step
    with core.signals.hold():  # a SIGTERM now waits for the final checkpoint
        parts.checkpoints.save(core.step, reason="final")
        parts.checkpoints.flush()
    digests = gather_digests(ctx, parameter_digest(model))
    if core.survivors is not None:
        core.survivors.job_ended(ctx)  # workers still waiting to join leave
    core.events.emit("end", step=core.step, world_size=ctx.world_size, loss=loop.last_loss, param_digests=digests,
                     **end_fields)
    if loop.report is not None:
        loop.report.close()
    if len(set(digests)) != 1:
        raise ElasticError(f"ranks ended with different parameters (digests {digests}); the replicas diverged")
    return loop.summary(ctx.rank, core.first_step, parts.checkpoints.loop_seconds())
