"""Preemption the Slurm way: the signal a batch script asks for (`#SBATCH --signal=USR1@90`) stops
the job like SIGTERM does (commit the current step, leave), and then the job requeues itself.

The signal is `TORCHREVIVE_REQUEUE_SIGNAL` (USR1 by default; USR2 for those who keep USR1 for
something else, as submitit does; `none`: no requeue signal). Agents and workers inherit the same
variable, so both sides agree on it.

Invariants:
- The signal is handled only inside a Slurm job (SLURM_JOB_ID set): elsewhere USR1 keeps its
  meaning. Slurm sends it to every process of a step (`--signal`, `scancel --signal`), so the
  processes that do not act on it ignore it (`ignore_in_helper`: the warm-start fork server, and
  what a worker forks: data loader workers), instead of dying of its default action.
- Exactly one process requeues: worker rank 0 when tasks run without an agent (`srun python
  script.py`), the agent of the step's first node under `srun torchrevive-run`; each only after
  the preemption's checkpoint committed on every rank. A job submitted without `--requeue`
  is not requeued (one line says so).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Mapping

from elastic.errors import UsageError
from elastic.slurm.control import SlurmControlError, requeue, requeue_allowed

logger = logging.getLogger(__name__)

REQUEUE_SIGNAL_ENV = "TORCHREVIVE_REQUEUE_SIGNAL"
ALLOWED = {"USR1": signal.SIGUSR1, "USR2": signal.SIGUSR2}


def requeue_signal(environ: Mapping[str, str]) -> signal.Signals | None:
    """The requeue signal inside a Slurm job (None outside one, or when set to `none`).

    Raises `UsageError` (one line, exit 2) for a name other than USR1, USR2 or none."""
    if not environ.get("SLURM_JOB_ID"):
        return None
    raw = environ.get(REQUEUE_SIGNAL_ENV, "USR1").strip().upper()
    name = raw.removeprefix("SIG")
    if name == "NONE":
        return None
    if name not in ALLOWED:
        raise UsageError(f"{REQUEUE_SIGNAL_ENV}={raw!r} is not USR1, USR2 or none")
    return ALLOWED[name]


def ignore_in_helper(environ: Mapping[str, str]) -> None:
    """In a process that does not act on the requeue signal but must outlive it (a fork server, a data
    loader worker): ignore it. Slurm signals every process of a step, and the signal's default action
    ends a process; an ignored signal stays ignored in forked and exec'd children, until a worker's
    `elastic.preemption.PreemptionHandler` takes it over."""
    try:
        signum = requeue_signal(environ)
    except UsageError:
        return  # the agent and the worker refuse it with one line; a helper has no say
    if signum is not None:
        signal.signal(signum, signal.SIG_IGN)


def requeue_from_rank0(job_id: int | None, stopped: str) -> str:
    """On rank 0 after a preemption's commit (`stopped` says which step): in a Slurm job with no
    agent (`job_id` set) requeue it, log the line at once (the requeue's SIGTERM may end this
    process before its exit line) and return it as `; <line>`; '' under an agent, which requeues."""
    if job_id is None:
        return ""
    line = requeue_after_preemption(job_id)
    logger.warning("stopped %s; %s", stopped, line)
    return f"; {line}"


def requeue_after_preemption(job_id: int) -> str:
    """Requeue job `job_id` if it may be; the one line that says what happened."""
    try:
        if not requeue_allowed(job_id):
            return f"Slurm job {job_id} not requeued: it was submitted without --requeue"
        requeue(job_id)
    except SlurmControlError as exc:
        return f"Slurm job {job_id} not requeued: {exc}"
    return f"Slurm job {job_id} requeued (scontrol requeue); it resumes from this checkpoint"
