"""The worker's environment, read once: what its launcher and agent told it, as typed fields.

    env = WorkerEnv.read()          # when a run opens; init_worker(env=env) puts it on the context
    ctx.env.node, ctx.env.notes_dir # every part after that reads the context, never the process

Invariants:
- This is the one module of the worker side that reads the process environment (`os.environ`),
  and only in `WorkerEnv.read`, which takes a read-only copy: a variable set or changed later
  (by the script, by a library) is not seen, so every part of one run reads the same values.
- The launcher's variables are parsed here too (`parse_launch_env`, into a `LaunchEnv`): a plain
  `python` start (neither RANK nor WORLD_SIZE set) is a job of one, `SINGLE_PROCESS`; a task of
  an srun step without torchrun's variables takes its place from Slurm's (`elastic._shared.slurm.step`).
- A bad launcher value is an `EnvironmentConfigError` (one line) where it is parsed, as before
  this module: `init_worker` parses the place, the run's `PreemptionHandler` asks for `preemption`.
"""

from __future__ import annotations

import os
import socket
import types
from collections.abc import Mapping
from dataclasses import dataclass, field

from elastic._shared.common.errors import EnvironmentConfigError
from elastic._shared.protocol import worker_notes
from elastic._shared.slurm import step as slurm_step
from elastic._shared.slurm.requeue import preemption_settings
from elastic._shared.storage.keeper_address import NODE_ENV


def _digits(raw: str | None) -> int | None:
    return int(raw) if raw is not None and raw.isascii() and raw.isdigit() else None


@dataclass(frozen=True, kw_only=True)
class WorkerEnv:
    """This worker's environment as it was when the run opened (see the module docstring)."""

    variables: Mapping[str, str] = field(repr=False, hash=False)
    """The read-only copy of every variable, for the parsers of the launcher's variables that take a
    mapping (`parse_launch_env`, the stores, the survivors' heal point, Slurm). Never printed: it
    may hold the job's secret."""
    host: str
    """This machine's host name."""
    node: str
    """This worker's node as the job's agents name it (their failures, hangs, nodes set aside): the
    snapshot keeper's node name, which torchrevive-run gives its workers; else the host name."""
    notes_dir: str | None
    """The folder this node's agent reads its workers' notes from (torchrevive-run); None without one."""
    local_rank: int | None
    """LOCAL_RANK when it is a number, else None: the agent's notes are per local rank."""
    rank_hint: int | None
    """RANK when it is a number, else None: for the log lines before the group exists (the place
    itself is `parse_launch_env`'s, which refuses a bad value)."""

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        """`environ` (a test's, a caller's), else a read-only copy of this process's environment."""
        variables = types.MappingProxyType(dict(os.environ if environ is None else environ))
        host = socket.gethostname()
        return cls(
            variables=variables, host=host, node=variables.get(NODE_ENV) or host,
            notes_dir=variables.get(worker_notes.NOTES_ENV) or None,
            local_rank=_digits(variables.get("LOCAL_RANK")), rank_hint=_digits(variables.get("RANK")),
        )

    @classmethod
    def bare(cls) -> WorkerEnv:
        """No launcher and no agent: what a context built by hand (a test's) holds."""
        return cls.read({})

    @property
    def preemption(self) -> dict[str, float | int | None]:
        """`PreemptionHandler`'s options (`elastic._shared.slurm.requeue.preemption_settings`). Parsed when
        asked, so a misnamed requeue signal is refused where the handler is built, as it always was."""
        return preemption_settings(self.variables)


@dataclass(frozen=True, kw_only=True)
class LaunchEnv:
    """What torchrun (torch.distributed.run) told this worker through its environment."""

    rank: int
    """Global rank of this worker, 0 <= rank < world_size."""
    local_rank: int
    """Rank among the workers of this node (agent), 0 <= local_rank < local_world_size."""
    world_size: int
    """Number of workers in the job in this rendezvous round."""
    local_world_size: int
    """Number of workers started by this node's agent."""
    restart_count: int
    """How many times this agent has restarted its workers (TORCHELASTIC_RESTART_COUNT)."""
    run_id: str
    """The job's rendezvous id (TORCHELASTIC_RUN_ID); "local" for a single process."""
    launched: bool
    """True when started by a launcher (torchrun, or srun without one), False for plain `python`."""
    slurm_task: slurm_step.SlurmTask | None = None
    """Set for a task of an srun step with no agent: it meets its peers at the step's first node."""


SINGLE_PROCESS = LaunchEnv(
    rank=0, local_rank=0, world_size=1, local_world_size=1, restart_count=0, run_id="local", launched=False
)


def _read_int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise EnvironmentConfigError(
                f"{name} is not set although RANK/WORLD_SIZE are: start workers with torchrun, "
                "or unset RANK and WORLD_SIZE to run a single process"
            )
        return default
    try:
        value = int(raw)
    except ValueError:
        raise EnvironmentConfigError(f"{name}={raw!r} is not an integer") from None
    if value < 0:
        raise EnvironmentConfigError(f"{name}={value} is negative")
    return value


def parse_launch_env(environ: Mapping[str, str]) -> LaunchEnv:
    """Parse the torchrun environment (else an srun step's); a plain `python` start gives `SINGLE_PROCESS`.

    Raises `EnvironmentConfigError` (one line) for values that are missing,
    not integers, negative, or inconsistent (rank outside the world).
    """
    if "RANK" not in environ and "WORLD_SIZE" not in environ:
        return _slurm_launch_env(environ) if slurm_step.in_step(environ) else SINGLE_PROCESS
    rank = _read_int(environ, "RANK")
    world_size = _read_int(environ, "WORLD_SIZE")
    # LOCAL_* default to a one-worker node: launchers other than torchrun often omit them.
    local_rank = _read_int(environ, "LOCAL_RANK", default=0)
    local_world_size = _read_int(environ, "LOCAL_WORLD_SIZE", default=1)
    restart_count = _read_int(environ, "TORCHELASTIC_RESTART_COUNT", default=0)
    if world_size < 1:
        raise EnvironmentConfigError(f"WORLD_SIZE={world_size} must be at least 1")
    if rank >= world_size:
        raise EnvironmentConfigError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
    if local_world_size < 1 or local_world_size > world_size:
        raise EnvironmentConfigError(
            f"LOCAL_WORLD_SIZE={local_world_size} must be between 1 and WORLD_SIZE={world_size}"
        )
    if local_rank >= local_world_size:
        raise EnvironmentConfigError(f"LOCAL_RANK={local_rank} is outside LOCAL_WORLD_SIZE={local_world_size}")
    run_id = environ.get("TORCHELASTIC_RUN_ID") or "none"
    return LaunchEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        restart_count=restart_count,
        run_id=run_id,
        launched=True,
    )


def _slurm_launch_env(environ: Mapping[str, str]) -> LaunchEnv:
    """A task of `srun python script.py`: its place from Slurm's variables."""
    try:
        task = slurm_step.read_task(environ)
    except ValueError as exc:
        raise EnvironmentConfigError(f"Slurm step: {exc}") from None
    return LaunchEnv(
        rank=task.rank, local_rank=task.local_rank, world_size=task.world_size,
        local_world_size=task.local_world_size, restart_count=task.restart_count,
        run_id=f"slurm-{task.job_id}", launched=True, slurm_task=task,
    )
