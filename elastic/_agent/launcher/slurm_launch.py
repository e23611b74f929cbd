"""`srun torchrevive-run --rdzv-endpoint=slurm ...`: one agent per node of a Slurm step, and the
Slurm way of being preempted (commit on the requeue signal, then requeue the job).

`--rdzv-endpoint=slurm` is spelled out from the step (elastic._shared.slurm.step):

- the endpoint: the step's first node (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST, expanded as
  `scontrol show hostnames` does; its NodeAddr when the name does not resolve), on port
  20000 + job id mod 5000, the same for every agent without talking and for every run of a
  requeued job;
- `--rdzv-backend c10d` (torchrun's default, static, has no endpoint to meet at) hosted by the
  first node's agent (`is_host`, unless `--rdzv-conf` says otherwise), which takes the port at once
  (`hold_store_port`): a port another process holds (a local user who listened there first) is one
  line and exit 2, never a store shared with a stranger's;
- `--rdzv-id slurm-JOBID` unless given: a requeued job's agents are the same run;
- `--nnodes 1:N` for an N-node step unless given (`--nnodes`, PET_NNODES): the job goes on with
  what is left of the allocation; give `--nnodes MIN:N` to ask for more.

`--rdzv-endpoint=slurm:JOBID` is the same rendezvous seen from another allocation: agents started
there (a replacement node) join running job JOBID's training, within its --nnodes.

Invariants:
- Outside a Slurm job `--rdzv-endpoint=slurm` is one line and exit 2, as are a backend other
  than c10d with it, `slurm:JOBID` for a job that is not running, and, on the first node, a
  rendezvous port that another process holds.
- One agent per node: `--rdzv-endpoint=slurm` in a step with more tasks on a node is refused.
- The requeue signal (elastic._shared.slurm.requeue) makes this agent stop its workers the way SIGTERM
  does (they commit this step and exit); then the step's first agent (SLURM_PROCID 0), and only
  it, requeues the job, and only when a worker of its node noted the commit. Before the workers
  start, the signal is remembered and the agent leaves without starting them. SIGTERM alone
  (scancel, the time limit) never requeues.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Mapping
from types import FrameType

from elastic._agent.launcher.stop_signals import raise_safely
from elastic._agent.rendezvous import c10d_store
from elastic._agent.rendezvous.held_port import PortTaken
from elastic._shared.common.errors import UsageError
from elastic._shared.slurm import step as slurm_step
from elastic._shared.slurm.control import SlurmControlError, node_address, nodes_of_job
from elastic._shared.slurm.requeue import (
    NOTES_ENV,
    arrived_early,
    noted_commits,
    requeue_after_preemption,
    requeue_signal,
)

SLURM_ENDPOINT = "slurm"


def expand_endpoint(args: argparse.Namespace, environ: Mapping[str, str], *, nnodes_given: bool) -> int | None:
    """Replace `--rdzv-endpoint=slurm` (this job's rendezvous) or `slurm:JOBID` (running job JOBID's, for
    agents of another allocation joining it) by the host and port (see the module docstring); other
    endpoints stay. The port this agent's store must take (`hold_store_port`) when it hosts it, else None."""
    endpoint = args.rdzv_endpoint or ""
    if endpoint != SLURM_ENDPOINT and not endpoint.startswith(f"{SLURM_ENDPOINT}:"):
        return None
    if args.rdzv_backend not in ("static", "c10d", "c10d-sealed"):
        raise UsageError(f"--rdzv-endpoint={endpoint} meets at a job's first node's c10d store; --rdzv-backend "
                         f"{args.rdzv_backend} needs an endpoint of its own (HOST:PORT)")
    try:
        if endpoint == SLURM_ENDPOINT:
            if not slurm_step.in_job(environ):
                raise UsageError("--rdzv-endpoint=slurm needs a Slurm job (SLURM_JOB_ID is not set): start the "
                                 "agents with srun inside an allocation, or give --rdzv-endpoint HOST:PORT")
            job_id, nodes = slurm_step.job_id(environ), slurm_step.job_nodes(environ)
            if slurm_step.in_step(environ):
                node = slurm_step.read_int(environ, "SLURM_NODEID")
                if node < len(nodes) and slurm_step.tasks_on_node(environ, node, len(nodes)) > 1:
                    raise UsageError("--rdzv-endpoint=slurm runs one agent per node (srun --ntasks-per-node=1); "
                                     "give --nproc-per-node for the workers of each node")
            hosts = environ.get("SLURMD_NODENAME", "") == nodes[0]
        else:
            text = endpoint.removeprefix(f"{SLURM_ENDPOINT}:")
            if not text.isdigit() or int(text) < 1:
                raise UsageError(f"--rdzv-endpoint={endpoint}: {text!r} is not a Slurm job id")
            job_id = int(text)
            nodes, hosts = nodes_of_job(job_id), False  # that job's first node hosts its rendezvous
        host = node_address(nodes[0])
    except (ValueError, SlurmControlError) as exc:
        raise UsageError(f"--rdzv-endpoint={endpoint}: {exc}") from None
    port = slurm_step.port_of(job_id, slurm_step.RENDEZVOUS_PORT_BASE)
    args.rdzv_endpoint = f"{host}:{port}"
    args.rdzv_backend = "c10d"
    if args.rdzv_id in (None, "", "none"):
        args.rdzv_id = f"slurm-{job_id}"
    if not nnodes_given:
        args.nnodes = f"1:{len(nodes)}"
    conf = args.rdzv_conf or ""
    ours = "is_host" not in {item.split("=", 1)[0].strip() for item in conf.split(",")}
    if ours:
        args.rdzv_conf = ",".join(filter(None, [conf, f"is_host={str(hosts).lower()}"]))
    print(f"torchrevive-run: Slurm job {job_id}'s rendezvous at {args.rdzv_endpoint}, run id {args.rdzv_id}, "
          f"--nnodes {args.nnodes}", file=sys.stderr, flush=True)
    return port if ours and hosts else None


def hold_store_port(port: int) -> None:
    """Take the rendezvous store's `port` on this node now, for the store this agent hosts
    (elastic._agent.rendezvous.held_port); `UsageError` in one line when another process holds it."""
    try:
        c10d_store.hold(port)
    except PortTaken as exc:
        raise UsageError(f"--rdzv-endpoint=slurm: {exc}") from None


class RequeueSignal:
    """The agent's side of the requeue signal: stop the workers as SIGTERM would, then (the step's first
    agent only) requeue the job once a worker of this node noted the preemption's commit."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.received = arrived_early()
        self._environ = environ
        self._launched = False
        self._before_workers = False  # the signal came before any worker started
        self.notes: str | None = None
        self.signum = requeue_signal(environ)  # UsageError for a bad TORCHREVIVE_REQUEUE_SIGNAL
        if self.signum is not None:
            signal.signal(self.signum, raise_safely(self._on_signal))

    def launching(self) -> None:
        """The workers are about to start: from now on the signal stops them. They note their commit in a
        folder of this agent's (`elastic._shared.slurm.requeue.note_commit`). If the signal came already, this
        raises the stop at once: no worker is started (and the requeue needs no note)."""
        if self.signum is not None:
            self.notes = tempfile.mkdtemp(prefix="torchrevive-preemption-")
            os.environ[NOTES_ENV] = self.notes
        self._launched = True  # first: a signal from now on raises in the handler; one before, here
        if self.received:
            self._before_workers = True
            self._stop()

    def _stop(self) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        # torch's agent handles SIGTERM by raising this from its handler; its workers get SIGTERM,
        # which after the requeue signal they take as the same stop (elastic._worker.control.preemption).
        raise SignalException(f"Process {os.getpid()} got the requeue signal", sigval=signal.SIGTERM)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received:
            return  # Slurm may send it to every process of the step, and twice; one stop is enough
        self.received = True
        print(f"torchrevive-run: received {signal.Signals(signum).name}: stopping the workers (they commit this "
              "step), then requeueing the Slurm job", file=sys.stderr, flush=True)
        if self._launched:
            self._stop()

    def requeue_if_first(self) -> str | None:
        """After the workers stopped: the one line of the step's first agent (SLURM_PROCID 0) about the
        requeue; None elsewhere or when the signal never came."""
        if not self.received or self._environ.get("SLURM_PROCID", "0") != "0":
            return None
        try:
            job_id = slurm_step.job_id(self._environ)
        except ValueError as exc:
            return f"Slurm job not requeued: {exc}"
        if not self._before_workers and not (self.notes and noted_commits(self.notes)):
            return (f"Slurm job {job_id} not requeued: no worker on this node reported the preemption's commit "
                    "(their lines above say why)")
        return requeue_after_preemption(job_id)

    def close(self) -> None:
        if self.notes is not None:
            shutil.rmtree(self.notes, ignore_errors=True)
