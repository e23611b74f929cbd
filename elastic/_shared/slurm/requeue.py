"""Preemption the Slurm way: the signal a batch script asks for (`#SBATCH --signal=USR1@90`) stops
the job like SIGTERM does (commit the current step, leave), and then the job requeues itself.

The signal is `TORCHREVIVE_REQUEUE_SIGNAL` (USR1 by default; USR2 for those who keep USR1 for
something else, as submitit does; `none`: no requeue signal). Agents and workers inherit the same
variable, so both sides agree on it; the batch script's `#SBATCH --signal` must name the same one.

Invariants:
- The signal is handled only inside a Slurm job (SLURM_JOB_ID set): elsewhere USR1 keeps its
  meaning. Slurm sends it to every process of a step (`--signal`, `scancel --signal`), so no
  process of ours dies of its default action: from `import elastic` on it is remembered
  (`catch_early`) until a handler takes it over and acts on it (the worker's
  `elastic._worker.control.preemption.PreemptionHandler`, the agent's `RequeueSignal`); helpers ignore it
  (`ignore_in_helper`: the warm-start fork server, what a worker forks).
- Exactly one process requeues, and only after the preemption's checkpoint committed on every rank
  (the commit is collective): worker rank 0 when tasks run without an agent (`srun python
  script.py`); under `srun torchrevive-run`, the step's first agent, once a worker of its node has
  noted the commit (`note_commit`). A job submitted without `--requeue`, or with no `--ckpt-dir`
  (a requeued run would start over), is not requeued; one line says so.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

from elastic._shared.common.errors import UsageError
from elastic._shared.slurm.control import SlurmControlError, requeue, requeue_allowed
from elastic._shared.timings import DUPLICATE_SIGTERM_WINDOW

logger = logging.getLogger(__name__)

REQUEUE_SIGNAL_ENV = "TORCHREVIVE_REQUEUE_SIGNAL"
NOTES_ENV = "TORCHREVIVE_PREEMPTION_NOTES"  # internal: the agent sets it for its workers (not a setting)
"""A folder the agent gives its workers: each writes `rank-N` there once its preemption commit is done."""
ALLOWED = {"USR1": signal.SIGUSR1, "USR2": signal.SIGUSR2}

_early: list[int] = []  # requeue signals that arrived before a handler took over (`catch_early`)


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


def preemption_settings(environ: Mapping[str, str]) -> dict[str, float | int | None]:
    """The worker's `PreemptionHandler` options: the requeue signal, and inside a Slurm job a window in
    which a second SIGTERM is the first one delivered twice (slurmstepd signals every process of a
    step on `scancel` and at the time limit, and the agent passes its own SIGTERM on at once)."""
    return {"requeue_signum": requeue_signal(environ),
            "duplicate_window": DUPLICATE_SIGTERM_WINDOW if environ.get("SLURM_JOB_ID") else 0.0}


def catch_early(environ: Mapping[str, str]) -> None:
    """From the start of a process in a Slurm job: the requeue signal is remembered (`arrived_early`),
    not fatal, until a handler takes it over. A no-op elsewhere, off the main thread, when the
    signal is misnamed (the agent and the worker refuse that with one line), or when the process
    already handles or ignores it (its own choice stands)."""
    try:
        signum = requeue_signal(environ)
    except UsageError:
        return
    if signum is None or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signum) is signal.SIG_DFL:
        signal.signal(signum, _remember)


def _remember(signum: int, frame: FrameType | None) -> None:
    _early.append(signum)


def arrived_early() -> bool:
    """Whether the requeue signal came before a handler took it over."""
    return bool(_early)


def ignore_in_helper(environ: Mapping[str, str]) -> None:
    """In a process that does not act on the requeue signal but must outlive it (a fork server, a data
    loader worker): ignore it. An ignored signal stays ignored in forked and exec'd children, until a
    worker's `elastic._worker.control.preemption.PreemptionHandler` takes it over."""
    try:
        signum = requeue_signal(environ)
    except UsageError:
        return
    if signum is not None:
        signal.signal(signum, signal.SIG_IGN)


def note_commit(environ: Mapping[str, str], rank: int, step: int) -> None:
    """A worker under an agent: its preemption commit of `step` is done (the agent requeues on it)."""
    folder = environ.get(NOTES_ENV)
    if not folder:
        return
    path = Path(folder) / f"rank-{rank}"
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        temporary.write_text(str(step))
        os.replace(temporary, path)
    except OSError as exc:  # the agent then says it saw no commit: the job is not requeued
        logger.warning("could not note the preemption commit for the agent (%s)", exc.strerror or exc)


def noted_commits(folder: str | Path) -> list[int]:
    """The steps the workers noted in `folder` (files that are not a step number are ignored)."""
    steps = []
    for path in Path(folder).glob("rank-*"):
        try:
            text = path.read_text()[:32].strip()
        except OSError:
            continue
        if text.isascii() and text.isdigit():
            steps.append(int(text))
    return steps


def after_preemption_commit(*, rank: int, job_id: int | None, committed: bool, said: str) -> str:
    """Every rank, after the requeue signal's preemption commit (`committed`: a checkpoint was written;
    the commit is noted for an agent beforehand, `note_commit`, whatever the signal): on rank 0 of a job
    without an agent (`job_id` set), requeue it, log the line at once (the requeue's SIGTERM may end
    this process before its exit line) and return it as `; <line>`. '' on the other ranks and under an
    agent."""
    if job_id is None or rank != 0:
        return ""
    if committed:
        line = requeue_after_preemption(job_id)
    else:
        line = f"Slurm job {job_id} not requeued: with no --ckpt-dir a requeued run would start over"
    logger.warning("stopped %s; %s", said, line)
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
