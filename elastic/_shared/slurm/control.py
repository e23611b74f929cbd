"""What a task asks of the Slurm controller, through `scontrol` and `squeue`: a node's address, another
job's owner and nodes, whether its job may be requeued, and the requeue itself.

Invariants:
- `scontrol` and `squeue` run with an argument list (no shell) and a time bound; one failing, hanging
  or being absent is a `SlurmControlError` with one line saying which and why, never a traceback.
- Another job's owner, state and nodes are read from `squeue`'s numeric uid, state and node list
  (`JOB_FORMAT`), never from `scontrol show job`: its record holds free text (the job's name, its
  command, its comment) that anyone may fill with `UserId=...` and so lie about whose job it is.
- Nothing here decides *whether* to requeue: callers requeue only after a preemption's checkpoint
  committed (elastic._worker.run.run, elastic._agent.launcher.slurm_launch), so an exit that must not be requeued
  (bad input, exit 2; a storage stop, exit 75) never reaches `requeue`.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess

from elastic._shared.slurm.hostlist import expand_hostlist
from elastic._shared.timings import SCONTROL_TIMEOUT


class SlurmControlError(RuntimeError):
    """scontrol is missing, failed or timed out."""


JOB_FORMAT = "%i %U %T %N"
"""What `squeue` prints of a job: its id, its owner's numeric uid, its state and its node list; no field
a user chooses freely, and none that holds a space."""


def _slurm(name: str, *args: str) -> str:
    """Run Slurm's program `name` with ARGS, return its stdout; `SlurmControlError` when it cannot."""
    program = shutil.which(name)
    if program is None:
        raise SlurmControlError(f"{name} is not on PATH")
    try:
        done = subprocess.run([program, *args], check=False, capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise SlurmControlError(f"{name} {' '.join(args)} did not answer in {SCONTROL_TIMEOUT:g} s") from None
    except OSError as exc:
        raise SlurmControlError(f"{name} {' '.join(args)} could not start ({exc.strerror})") from None
    if done.returncode != 0:
        why = next(iter(done.stderr.strip().splitlines()), f"exit status {done.returncode}")
        raise SlurmControlError(f"{name} {' '.join(args)} failed: {why}")
    return done.stdout


def scontrol(*args: str) -> str:
    """Run `scontrol ARGS`, return its stdout; `SlurmControlError` when it cannot."""
    return _slurm("scontrol", *args)


def _field(record: str, name: str) -> str | None:
    """`NAME=value` from one line of `scontrol show ... -o` (values hold no spaces for these fields)."""
    match = re.search(rf"(?:^|\s){re.escape(name)}=(\S*)", record)
    return match.group(1) if match else None


def node_address(node: str) -> str:
    """Where `node` is reached: its name when that resolves (the usual case), else the NodeAddr
    Slurm has for it (clusters whose node names are not host names)."""
    try:
        socket.getaddrinfo(node, None)
        return node
    except (OSError, UnicodeError):
        pass
    try:
        address = _field(scontrol("show", "node", "-o", node), "NodeAddr")
    except SlurmControlError as exc:
        raise SlurmControlError(f"node {node} is not a host name this machine resolves, and {exc}") from None
    if not address or address == "(null)":
        raise SlurmControlError(f"node {node} is not a host name this machine resolves, and Slurm has no NodeAddr "
                                "for it")
    return address


def nodes_of_job(job_id: int) -> list[str]:
    """The nodes of running job `job_id`, in Slurm's order (for agents of another allocation joining
    it), once `squeue` says the job is this user's; `SlurmControlError` otherwise, or when its answer
    is not one line of `JOB_FORMAT` for that very job."""
    answer = _slurm("squeue", "--noheader", f"--jobs={job_id}", f"--format={JOB_FORMAT}")
    lines = [line.split() for line in answer.splitlines() if line.strip()]
    for fields in lines:
        if len(fields) != 4 or not fields[1].isascii() or not fields[1].isdigit():
            raise SlurmControlError(f"squeue gave an unexpected answer for Slurm job {job_id} "
                                    f"(not '{JOB_FORMAT}': {' '.join(fields)[:120]!r})")
    mine = [fields for fields in lines if fields[0] == str(job_id)]  # an array's tasks are JOB_TASK
    if len(mine) > 1:
        raise SlurmControlError(f"squeue lists Slurm job {job_id} more than once")
    if not mine:
        raise SlurmControlError(f"Slurm job {job_id} is not running (squeue does not list it): there is no "
                                "rendezvous to join")
    _, uid, state, node_list = mine[0]
    if int(uid) != os.getuid():
        raise SlurmControlError(f"Slurm job {job_id} is not yours (uid {uid}): its rendezvous is not joined")
    if state != "RUNNING" or node_list == "(null)":
        raise SlurmControlError(f"Slurm job {job_id} is not running (state {state}): there is no rendezvous to join")
    try:
        return expand_hostlist(node_list)
    except ValueError as exc:
        raise SlurmControlError(f"Slurm job {job_id}: NodeList {exc}") from None


def requeue_allowed(job_id: int) -> bool:
    """Whether job `job_id` may be requeued (`sbatch --requeue`, or the cluster's JobRequeue=1)."""
    return _field(scontrol("show", "job", "-o", str(job_id)), "Requeue") == "1"


def requeue(job_id: int) -> None:
    """`scontrol requeue JOB`: Slurm ends this run of the job and queues it again."""
    scontrol("requeue", str(job_id))
