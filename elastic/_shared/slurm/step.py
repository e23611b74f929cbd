"""A task's place in its Slurm job step, read from the variables `srun` sets.

`srun python script.py` starts one task per process and no agent: the task's
rank, world size, local rank and local world size, and where rank 0 listens,
come from Slurm's variables instead of torchrun's. A shell of `sbatch` or
`salloc` has some of the same variables but is not a task of a step (it has no
SLURM_STEP_ID): a script run there is a job of one, as under plain `python`.

Invariants:
- `in_step` is true only inside a task of an srun step; torchrun's variables, when present, win
  over Slurm's (`elastic._worker.runtime.worker_env.parse_launch_env` asks Slurm only when RANK and WORLD_SIZE are
  both absent).
- The step's own variables (SLURM_STEP_NUM_TASKS, SLURM_STEP_TASKS_PER_NODE, SLURM_STEP_NODELIST)
  are read before the job's: a step may use part of the allocation.
- Every value is checked before use; a bad one is a `ValueError` naming the variable.
- Rank 0 is on the step's first node (srun's block, cyclic and plane distributions all start
  there), so the rendezvous address is that node's; MASTER_ADDR and MASTER_PORT, when set, win.
  An arbitrary distribution without MASTER_ADDR is refused: rank 0 may be anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from elastic._shared.slurm.hostlist import expand_hostlist, expand_tasks_per_node

RENDEZVOUS_PORT_BASE = 20000
"""`torchrevive-run --rdzv-endpoint=slurm` listens on BASE + job id mod PORT_SPAN."""
MASTER_PORT_BASE = 25000
"""`srun python script.py`: rank 0's store listens on BASE + (job id + step id) mod PORT_SPAN, so the
steps of one job running side by side (`srun --exact` in the background) listen apart."""
PORT_SPAN = 5000  # both ranges below Linux's ephemeral ports (32768 on)


def in_step(environ: Mapping[str, str]) -> bool:
    """Whether this process is a task of an srun step (not a batch or salloc shell)."""
    return bool(environ.get("SLURM_JOB_ID")) and bool(environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID")))


def in_job(environ: Mapping[str, str]) -> bool:
    """Whether this process runs inside a Slurm allocation (a step's task or the batch shell)."""
    return bool(environ.get("SLURM_JOB_ID"))


@dataclass(frozen=True, kw_only=True)
class SlurmTask:
    """One task of a step, as `srun` described it."""

    job_id: int
    rank: int
    """SLURM_PROCID."""
    world_size: int
    """Tasks in the step."""
    local_rank: int
    """SLURM_LOCALID."""
    local_world_size: int
    """Tasks of the step on this task's node."""
    node_index: int
    """SLURM_NODEID: this node's place in the step's node list."""
    nodes: tuple[str, ...]
    """The step's nodes, in Slurm's order."""
    master_port: int
    restart_count: int
    """SLURM_RESTART_COUNT: how many times the job was requeued."""


def read_int(environ: Mapping[str, str], *names: str, minimum: int = 0) -> int:
    """The first of `names` that is set, as an integer >= `minimum`."""
    for name in names:
        raw = environ.get(name)
        if raw is None or not raw.strip():
            continue
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not an integer") from None
        if value < minimum:
            raise ValueError(f"{name}={value} must be at least {minimum}")
        return value
    raise ValueError(f"{' or '.join(names)} is not set although this is a Slurm step (SLURM_STEP_ID is)")


def job_id(environ: Mapping[str, str]) -> int:
    return read_int(environ, "SLURM_JOB_ID", "SLURM_JOBID", minimum=1)


def job_nodes(environ: Mapping[str, str]) -> list[str]:
    """The step's (else the job's) nodes, expanded."""
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        text = environ.get(name)
        if text:
            try:
                return expand_hostlist(text)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
    raise ValueError("SLURM_JOB_NODELIST is not set although SLURM_JOB_ID is")


def job_port(environ: Mapping[str, str], base: int) -> int:
    """A port the job's tasks agree on without talking: `base` + job id mod PORT_SPAN."""
    return port_of(job_id(environ), base)


def port_of(job: int, base: int) -> int:
    """Job `job`'s port in the range starting at `base`."""
    return base + job % PORT_SPAN


def read_task(environ: Mapping[str, str]) -> SlurmTask:
    """This task's place in its step (call only when `in_step`)."""
    nodes = job_nodes(environ)
    world_size = read_int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS", minimum=1)
    rank = read_int(environ, "SLURM_PROCID")
    if rank >= world_size:
        raise ValueError(f"SLURM_PROCID={rank} is outside the step's {world_size} tasks")
    node_index = read_int(environ, "SLURM_NODEID")
    if node_index >= len(nodes):
        raise ValueError(f"SLURM_NODEID={node_index} is outside the step's {len(nodes)} nodes")
    local_world_size = tasks_on_node(environ, node_index, len(nodes))
    local_rank = read_int(environ, "SLURM_LOCALID")
    if local_rank >= local_world_size:
        raise ValueError(f"SLURM_LOCALID={local_rank} is outside the {local_world_size} tasks on this node")
    if local_world_size > world_size:
        raise ValueError(f"{local_world_size} tasks on this node but {world_size} in the step")
    if environ.get("SLURM_DISTRIBUTION", "").startswith("arbitrary") and not environ.get("MASTER_ADDR"):
        raise ValueError("SLURM_DISTRIBUTION=arbitrary may put rank 0 on any node: set MASTER_ADDR to its node")
    port = environ.get("MASTER_PORT")
    step = read_int(environ, "SLURM_STEP_ID", "SLURM_STEPID")
    default_port = port_of(job_id(environ) + step, MASTER_PORT_BASE)
    master_port = read_int(environ, "MASTER_PORT", minimum=1) if port else default_port
    if master_port > 65535:
        raise ValueError(f"MASTER_PORT={master_port} is not a port")
    restarts = read_int(environ, "SLURM_RESTART_COUNT") if environ.get("SLURM_RESTART_COUNT") else 0
    return SlurmTask(
        job_id=job_id(environ), rank=rank, world_size=world_size, local_rank=local_rank,
        local_world_size=local_world_size, node_index=node_index, nodes=tuple(nodes), master_port=master_port,
        restart_count=restarts,
    )


def tasks_on_node(environ: Mapping[str, str], node_index: int, node_count: int) -> int:
    """Tasks of the step on node `node_index`: from SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE
    (`2(x3),1`), else SLURM_NTASKS_PER_NODE."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        text = environ.get(name)
        if text:
            try:
                counts = expand_tasks_per_node(text)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
            if len(counts) != node_count:
                raise ValueError(f"{name}={text!r} names {len(counts)} nodes, the step has {node_count}")
            if counts[node_index] < 1:
                raise ValueError(f"{name}={text!r} gives this node no task")
            return counts[node_index]
    return read_int(environ, "SLURM_NTASKS_PER_NODE", minimum=1)
