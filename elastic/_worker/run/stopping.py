"""How a run stops on SIGTERM or Slurm's requeue signal: every rank commits the same step, then leaves.

Invariant: called on every rank at the same step (the step vote's verdict, read
alike everywhere); a storage failure raises here, so no requeue follows a
commit that did not happen.
"""

from __future__ import annotations

from typing import NoReturn

from elastic._shared.common.errors import Preempted
from elastic._shared.slurm.requeue import after_preemption_commit, note_commit
from elastic._worker.checkpoint import CheckpointManager
from elastic._worker.control.watchdog import NoWatchdog, Watchdog
from elastic._worker.runtime.context import WorkerContext


def commit_and_stop(
    checkpoints: CheckpointManager, watchdog: Watchdog | NoWatchdog, ctx: WorkerContext, step: int, *, requeue: bool
) -> NoReturn:
    """Commit `step`, then raise `Preempted` (exit status 143); after the Slurm requeue signal, rank 0
    of a job without an agent requeues it."""
    with watchdog.paused():  # a slow filesystem is not a hang
        checkpoints.save(step, reason="preemption")
        checkpoints.flush()
    saved = f"checkpoint committed in {checkpoints.store.root}" if checkpoints.enabled else None
    said = f"after step {step}; {saved or 'no --ckpt-dir, nothing saved'}"
    if checkpoints.enabled:
        # Under an agent the commit is noted whatever stopped this worker: the agent may have taken
        # Slurm's requeue signal first and stopped its workers with SIGTERM before Slurm's own
        # requeue signal reached them. The agent requeues only when it had that signal.
        note_commit(ctx.env.variables, ctx.rank, step)
    if requeue:
        said += after_preemption_commit(rank=ctx.rank, said=said, job_id=ctx.slurm_job_id, committed=checkpoints.enabled)
    raise Preempted(f"stopped by {'the Slurm requeue signal' if requeue else 'SIGTERM'} {said}")
