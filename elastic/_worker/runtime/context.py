"""Worker runtime: who this worker is in the job, its device, and the process group.

Invariants:
- The worker's environment is read once, when a run opens, into a `WorkerEnv`
  (elastic._worker.runtime.worker_env), and its launcher's place parsed from it into a
  `LaunchEnv`; the rest of the library takes the typed `WorkerContext`, which carries
  that `WorkerEnv` (`ctx.env`) for the parts that need more of it.
- A worker started by plain `python` (neither RANK nor WORLD_SIZE set) is a job
  of one: rank 0, world size 1, no process group, same code path otherwise.
- A task of an srun step without torchrun's variables (`srun python script.py`)
  meets its group at the step's first node, on a port derived from the job id
  (MASTER_ADDR and MASTER_PORT, when set, win).
- Under torchrun a process group is always created (at world size 1 too, so an
  elastic job that grows or shrinks runs the same code), always with a finite
  timeout so a dead peer becomes an error rather than a hang, and it is
  destroyed when the worker leaves `worker_context`.
- Leaving never waits on a peer that may be dead: after a failure the group is
  torn down without collectives (NCCL communicators aborted, not flushed), on a
  thread given `ERROR_TEARDOWN_DEADLINE`, past which it is left to process exit.
  Only a normal exit, after a barrier, destroys the group the collective way.
- That thread is an `elastic._shared.common.threads` one: the exit joins it (it may be inside
  `destroy_process_group`, C++ that a finalizing interpreter would unwind into
  an abort), or past the exit's bound ends the process without finalizing.
- A worker's GPU is cuda:LOCAL_RANK when it sees a GPU per local worker, and
  cuda:0 when it sees exactly one (CUDA_VISIBLE_DEVICES narrowed per task).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

# Before any group exists: torch.distributed.nn.functional's collectives take `group=group.WORLD`
# as a default argument, evaluated when the module is first imported (DDP imports it while it
# builds). Imported after a group was made, the default holds that group for good, so
# `destroy_process_group` cannot end its gloo threads, and one that wakes while the interpreter
# finalizes aborts the process at exit ("terminate called without an active exception").
import torch.distributed.nn.functional  # noqa: F401, E402 - imported for the side effect above

from elastic._shared.common import threads
from elastic._shared.common.errors import UsageError
from elastic._worker.config import DEVICE_CHOICES
from elastic._worker.runtime.round_store import recovery_hint
from elastic._worker.runtime.worker_env import WorkerEnv, parse_launch_env
from elastic._worker.runtime.worker_store import worker_store
from elastic._worker.timings import DEFAULT_COLLECTIVE_TIMEOUT, ERROR_TEARDOWN_DEADLINE

logger = logging.getLogger(__name__)

# A gloo group over all ranks for small host-side exchanges (preemption votes,
# RNG states) when the main group is NCCL: they then cost no device sync.
_control_group: dist.ProcessGroup | None = None
_overrun_teardowns: list[threading.Event] = []
"""Set when each teardown that overran its deadline ends (see `teardown_pending`)."""


def select_device(
    requested: str, local_rank: int, local_world_size: int, *, cuda_device_count: int | None = None
) -> torch.device:
    """Map `--device {auto,cpu,cuda}` to this worker's device.

    auto: a GPU when CUDA is usable, else cpu; cuda: a GPU or an error. The GPU
    is cuda:LOCAL_RANK when this process sees at least LOCAL_WORLD_SIZE GPUs
    (torchrun on a whole node), cuda:0 when it sees exactly one (a GPU per task
    or container). Any other count is a `UsageError` saying what to change.
    """
    if requested not in DEVICE_CHOICES:
        raise UsageError(f"--device {requested!r} is not one of {', '.join(DEVICE_CHOICES)}")
    if cuda_device_count is None:
        cuda_device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cpu" or (requested == "auto" and cuda_device_count == 0):
        return torch.device("cpu")
    if cuda_device_count == 0:
        raise UsageError("--device cuda was asked for but no CUDA device is visible; use --device cpu or auto")
    if cuda_device_count == 1:
        return torch.device("cuda", 0)
    if local_rank < cuda_device_count and cuda_device_count >= local_world_size:
        return torch.device("cuda", local_rank)
    raise UsageError(
        f"LOCAL_RANK={local_rank} has no GPU: {cuda_device_count} are visible to each of the "
        f"{local_world_size} workers on this node, which needs one per worker; start "
        f"--nproc-per-node={cuda_device_count} workers, or make exactly one GPU visible to each "
        "(CUDA_VISIBLE_DEVICES per task)"
    )


def backend_for(device: torch.device) -> str:
    """nccl for CUDA devices, gloo for the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass(frozen=True, kw_only=True)
class WorkerContext:
    """One worker's place in the job. Immutable: an elastic resize through a rendezvous round
    restarts the worker with a new one, and a group that changes in place (elastic._worker.survivors.views) gives
    the worker a new one with its rank and world size in that group."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    restart_count: int
    run_id: str
    device: torch.device
    backend: str | None
    """Process group backend, or None when running as a single process without one."""
    slurm_job_id: int | None = None
    """The Slurm job of a task started by srun with no agent (it requeues the job itself)."""
    env: WorkerEnv = field(default_factory=WorkerEnv.bare, repr=False)
    """The environment the worker opened with, read once (`init_worker`, `adopt_worker`); a group that
    changes in place keeps it. A context built by hand (a test's) holds a bare one: no launcher, no agent."""

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the event log, the progress bar and checkpoints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def init_worker(
    device: str = "auto",
    *,
    timeout: timedelta = DEFAULT_COLLECTIVE_TIMEOUT,
    env: WorkerEnv | None = None,
    environ: Mapping[str, str] | None = None,
    store: dist.Store | None = None,
    place: tuple[int, int] | None = None,
) -> WorkerContext:
    """Read the environment, pick the device and, under torchrun, join the process group
    (on `store` when given: a heal in place's namespace, elastic._worker.survivors.regroup.heal_group_store; at
    `place`, (rank, world size), when given instead of the launcher's: a worker that waits
    to join a group that trains on holds a group of its own meanwhile, elastic._worker.survivors.views).
    The environment is `env`, else `WorkerEnv.read(environ)` (`environ`: a test's, else the process's)."""
    worker_env = _worker_env(env, environ)
    environ = worker_env.variables
    launch = parse_launch_env(environ)
    if launch.rank == 0:
        log_recovery_hint(environ)
    if place is not None:
        launch = dataclasses.replace(launch, rank=place[0], world_size=place[1])
    dev = select_device(device, launch.local_rank, launch.local_world_size)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = None
    if launch.launched:
        backend = backend_for(dev)
        # TORCH_NCCL_ASYNC_ERROR_HANDLING is left as the launcher set it: torchrun sets it
        # to 1 itself, and elsewhere torch's own default (tear the process down without
        # cleaning up communicators) cannot hang in ncclCommAbort the way 1 can.
        dist.init_process_group(
            backend,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timeout,
            device_id=dev if dev.type == "cuda" else None,
            # This round's store or a Slurm step's own, sealed with the job's secret, or a namespace no
            # earlier round used (elastic._worker.runtime.worker_store); otherwise None, torch's env://.
            store=(store if store is not None else worker_store(
                environ, rank=launch.rank, world_size=launch.world_size, timeout=timeout,
                slurm_task=launch.slurm_task)),
        )
        if backend == "nccl":
            global _control_group
            _control_group = dist.new_group(backend="gloo", timeout=timeout)
    ctx = WorkerContext(
        rank=launch.rank,
        local_rank=launch.local_rank,
        world_size=launch.world_size,
        local_world_size=launch.local_world_size,
        restart_count=launch.restart_count,
        run_id=launch.run_id,
        device=dev,
        backend=backend,
        slurm_job_id=launch.slurm_task.job_id if launch.slurm_task is not None else None,
        env=worker_env,
    )
    logger.info(
        "worker ready: run=%s rank=%d/%d local_rank=%d device=%s backend=%s restart=%d",
        ctx.run_id, ctx.rank, ctx.world_size, ctx.local_rank, ctx.device, ctx.backend, ctx.restart_count,
    )
    return ctx


def adopt_worker(
    device: str = "auto",
    *,
    timeout: timedelta = DEFAULT_COLLECTIVE_TIMEOUT,
    env: WorkerEnv | None = None,
    environ: Mapping[str, str] | None = None,
) -> WorkerContext:
    """The context of a worker whose script already called `init_process_group`.

    Rank and world size come from the group; the rest from the launcher's
    environment. The group is left as it is: whoever created it destroys it.
    On NCCL a gloo group for host-side exchanges is added (a collective: every
    rank adopts at the same point). The environment is as `init_worker`'s.
    """
    worker_env = _worker_env(env, environ)
    launch = parse_launch_env(worker_env.variables)
    dev = select_device(device, launch.local_rank, launch.local_world_size)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = str(dist.get_backend())
    if backend == "nccl":
        global _control_group
        _control_group = dist.new_group(backend="gloo", timeout=timeout)
    return WorkerContext(
        rank=dist.get_rank(),
        local_rank=launch.local_rank,
        world_size=dist.get_world_size(),
        local_world_size=launch.local_world_size,
        restart_count=launch.restart_count,
        run_id=launch.run_id,
        device=dev,
        backend=backend,
        env=worker_env,
    )


def _worker_env(env: WorkerEnv | None, environ: Mapping[str, str] | None) -> WorkerEnv:
    if env is not None and environ is not None:
        raise ValueError("give the worker's environment as env or as environ, not both")
    return env if env is not None else WorkerEnv.read(environ)


def log_recovery_hint(environ: Mapping[str, str]) -> None:
    """Under plain torchrun with settings that cost recoveries what no worker can win
    back (torch's 30 s last call; a shared agent store, which times out a node that
    joins after the first round), one line leading to the fast path
    (`round_store.recovery_hint`); nothing otherwise. A dead round's keys in a
    shared store need no warning: `round_store.round_store` keeps rounds apart."""
    hint = recovery_hint(environ)
    if hint is not None:
        logger.warning(hint)


def shutdown_worker(*, failed: bool = False, deadline: timedelta = ERROR_TEARDOWN_DEADLINE) -> None:
    """Tear the process group down if one exists; safe to call more than once.

    `failed=False`, every rank leaving together after a barrier: destroy it (on
    NCCL a flush of each communicator, which waits for the peers' kernels).
    `failed=True`, peers perhaps dead: nothing that waits on a peer (see
    `error_teardown`), run on a thread given `deadline`; past it the worker goes
    on with one warning line, and its exit waits a bounded time for the thread
    (`elastic._shared.common.threads`), then ends without finalizing.
    """
    global _control_group
    _control_group = None
    if not (dist.is_available() and dist.is_initialized()):
        return
    if not failed:
        dist.destroy_process_group()
        return
    rank = dist.get_rank()
    teardown = error_teardown(str(dist.get_backend()))
    # A thread starts on device 0: give it this worker's, where the communicators live.
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def run() -> None:
        if device is not None:
            torch.cuda.set_device(device)
        teardown()

    _run_with_deadline(run, deadline, f"rank {rank}: leaving the process group after a failure")


def error_teardown(backend: str) -> Callable[[], None]:
    """How a failed worker leaves a process group of `backend` without waiting on its peers.

    NCCL: abort every communicator (`ncclCommAbort`, all as one NCCL group), since
    `destroy_process_group` flushes them (`ncclCommFinalize`), which waits for
    peers that may be dead. Other backends (gloo): `destroy_process_group`,
    which sends nothing there (gloo has no shutdown step), though it waits for a
    collective still in flight, up to the collective timeout if its peer is stuck:
    `shutdown_worker`'s deadline bounds that.
    """
    if "nccl" in backend:  # "nccl", or "cpu:gloo,cuda:nccl"
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        return abort if abort is not None else _leave_to_process_exit
    return dist.destroy_process_group


def _leave_to_process_exit() -> None:
    """Without an abort API: an NCCL group never destroyed is aborted by its destructor at exit."""


def _run_with_deadline(action: Callable[[], None], deadline: timedelta, what: str) -> bool:
    """Run `action` on a library thread and wait at most `deadline`; True if it ended in time.

    A failure or an overrun is one warning line: the worker is already leaving with an error of its own.
    An overrun thread is left running; the exit joins it (`elastic._shared.common.threads`).
    """
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            action()
        except BaseException as exc:  # noqa: BLE001 - reported below, in one line
            errors.append(exc)
        finally:
            done.set()

    threads.start(run, name="elastic-group-teardown")
    if not done.wait(deadline.total_seconds()):
        logger.warning("%s took over %g s; leaving it to process exit", what, deadline.total_seconds())
        _overrun_teardowns.append(done)
        return False
    if errors:
        error = errors[0]
        first_line = next(iter(str(error).strip().splitlines()), "")
        logger.warning("%s failed (%s: %s); leaving it to process exit", what, type(error).__name__, first_line)
    return True


def teardown_pending() -> bool:
    """Whether a group this process left after a failure is still being torn down, its deadline
    passed: gloo's destructor waits for a collective in flight, so that group's sockets are still
    open, and a peer blocked in the same collective waits on them. Such a worker must not join a
    new group: only its exit closes them (and frees that peer)."""
    _overrun_teardowns[:] = [done for done in _overrun_teardowns if not done.is_set()]
    return bool(_overrun_teardowns)


def control_group() -> dist.ProcessGroup | None:
    """The group for host-side (CPU tensor, object) collectives: gloo in every job.

    None means the default group, which is gloo itself on CPU jobs.
    """
    return _control_group


@contextmanager
def worker_context(
    device: str = "auto", *, timeout: timedelta = DEFAULT_COLLECTIVE_TIMEOUT
) -> Iterator[WorkerContext]:
    """`init_worker` on entry, `shutdown_worker` on every exit path: after a barrier on
    a normal one, without waiting on peers (`failed=True`) when the body or the barrier failed."""
    ctx = init_worker(device, timeout=timeout)
    try:
        yield ctx
    except BaseException:
        leave_group(ctx, failed=True)
        raise
    leave_group(ctx, failed=False)


def barrier(ctx: WorkerContext) -> None:
    """Wait for every rank; a no-op for a single process."""
    if ctx.distributed:
        if ctx.backend == "nccl":
            dist.barrier(device_ids=[ctx.device.index])
        else:
            dist.barrier()


def leave_group(ctx: WorkerContext, *, failed: bool) -> None:
    """Leave the job's process group: together with the others (a barrier) unless this rank failed; a rank
    tearing its gloo pairs down while a peer still drains the last collective aborts that peer at exit (seen
    as SIGABRT). On failure (or a failed barrier) peers may be gone: nothing that waits on them."""
    left_together = False
    try:
        if not failed:
            barrier(ctx)
            left_together = True
    finally:
        shutdown_worker(failed=not left_together)
