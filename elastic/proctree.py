"""Processes below a process, from /proc (Linux): the agent's workers, a node's tree.

torchrun starts workers as children of its agent, warm workers are children of
the agent's fork server, and a worker may start processes of its own (data
loaders): code that signals "the workers of this node" walks the whole tree.
Off Linux every function here finds nothing.
"""

from __future__ import annotations

from pathlib import Path


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
