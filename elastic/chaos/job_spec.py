"""What a chaos job is: how many agents, which launcher and rendezvous, which script, where.

`JobSpec` describes one elastic job for `harness.ChaosJob` to start; `find_recipe`
finds the GPT recipe it runs by default. Nothing here starts a process.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic._shared.common.errors import UsageError
from elastic.chaos.etcd import EtcdServer
from elastic.chaos.netns import VirtualNetwork

RECIPE = Path("recipes") / "gpt.py"


def find_recipe(given: str | os.PathLike[str] | None = None) -> Path:
    """The GPT recipe the jobs run: `given`, else recipes/gpt.py in the current directory, else beside
    this package in a source checkout. An installed package has no recipes: one `UsageError` line."""
    if given is not None:
        path = Path(given)
        if not path.is_file():
            raise UsageError(f"--recipe {path}: no such file")
        return path.resolve()
    for candidate in (Path.cwd() / RECIPE, Path(__file__).resolve().parents[2] / RECIPE):
        if candidate.is_file():
            return candidate
    raise UsageError(
        f"the chaos harness runs the GPT recipe, {RECIPE} of a torchrevive checkout, and finds none in the "
        "current directory or beside this package: run it from a checkout, or pass --recipe PATH"
    )


@dataclass
class JobSpec:
    """One elastic job: how many agents, which rendezvous, which script."""

    workdir: Path
    script_args: Sequence[str]
    agents: int = 2
    nnodes: str = "1:3"
    backend: str = "c10d"
    endpoint: str | None = None
    """c10d: a free loopback port is picked; etcd-v3: HOST:PORT of etcd (required)."""
    max_restarts: int = 3
    launcher: str = "ours"
    """`ours` (python -m elastic._agent.launcher) or `stock` (torch.distributed.run)."""
    script: Path | None = None
    """The training script; None: the GPT recipe (`find_recipe`)."""
    rdzv_conf: str = "join_timeout=60,close_timeout=10"
    env: dict[str, str] = field(default_factory=dict)
    agent_env: dict[int, dict[str, str]] = field(default_factory=dict)
    """More environment for agent `index` alone (over `env`): e.g. a fault only one node's workers have."""
    run_id: str = "chaos"
    sample_log: Path | None = None
    """Record every rank's samples here (`elastic.chaos.samples`) for the exactly-once audit."""
    network: VirtualNetwork | None = None
    """Put each agent on a host of its own (a network namespace); None: all on loopback."""
    etcd: EtcdServer | None = None
    """The etcd of an etcd-v3 job, when the harness started it (and may restart it)."""
    start_process: Callable[..., Any] = subprocess.Popen
    """How an agent's process is started: `subprocess.Popen`'s arguments, a handle with its `pid`,
    `poll`, `wait` and `kill` back (a test suite's starter may fork agents warm)."""
