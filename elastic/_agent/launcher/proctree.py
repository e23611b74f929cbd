"""Processes below a process, from /proc (Linux): the agent's workers, a node's tree.

torchrun starts workers as children of its agent, warm workers are children of
the agent's fork server, and a worker may start processes of its own (data
loaders): code that signals "the workers of this node" walks the whole tree.
Off Linux every function here finds nothing.
"""

from __future__ import annotations

from pathlib import Path

WARM_WORKER_NAME = "python-rank"
"""Warm workers name themselves `python-rank<RANK>` (`elastic._agent.launcher.warm_start`)."""


def children(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc/PID/task/*/children: no scan of every process)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return found


def descendants(pid: int) -> list[int]:
    """Children, grandchildren and so on, parents before their children."""
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in children(parent)]
        found += frontier
    return found


def status(pid: int) -> dict[str, str]:
    """The fields of /proc/PID/status (empty when the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return {key: value.strip() for key, _, value in (line.partition(":") for line in text.splitlines())}


def worker_rank(pid: int) -> int | None:
    """The RANK of a torchrun worker, None for any other process: from the process
    name of a warm worker (they share their fork server's environment), else from
    the environment torchrun started the worker with."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    if comm.startswith(WARM_WORKER_NAME) and comm[len(WARM_WORKER_NAME):].isdigit():
        return int(comm[len(WARM_WORKER_NAME):])
    for item in environ:
        if item.startswith(b"RANK=") and item[5:].isdigit():
            return int(item[5:])
    return None
