"""Warm worker starts: workers forked from a process that has already imported torch.

torchrun starts every worker as a fresh `python -u script.py`, which imports
torch before it can do anything else: 1 to 3 s on a small CPU, more when the
workers of a node start together. A restart pays it again, on the critical path
of every recovery. `elastic.launch` instead starts workers with
multiprocessing's fork server, which imports the modules named in
`TORCHREVIVE_PRELOAD` (default: torch and torch._dynamo, which the first
optimizer step imports, another 1-2 s) once per agent; each worker of every
round is then a fork of that warm process and runs the training script in it.

Invariants:
- The fork server only imports modules: it never initialises CUDA or joins a
  process group, so a forked worker is as clean as a fresh interpreter as far
  as devices and collectives go. Modules
  that probe the GPU at import must not be preloaded; torch and torch._dynamo
  do not (torch initialises CUDA lazily, on first use).
- The script runs as `python -u SCRIPT ARGS` would run it: `sys.argv`, the
  script's folder first on `sys.path`, `__name__ == "__main__"`, line-buffered
  stdout and stderr, and its exit status is the worker's.
- A worker does not outlive its agent. torchrun's own workers, started in
  sessions of their own, run on as orphans when their agent is killed (OOM
  killer, node drain), holding their peers in collectives until a timeout;
  the fork server cannot end them either, since they keep it alive. A
  thread of each warm worker waits on the agent (a pidfd, no polling) and
  ends the worker with one line when the agent is gone.
- Each worker's process name (`/proc/PID/comm`, what `top` and `ps -o comm`
  show) is `python-rank<RANK>`: forked workers share the fork server's command
  line and initial environment, so this is how to tell them apart.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import runpy
import select
import sys
import threading
from collections.abc import Mapping

from elastic.errors import UsageError

PRELOAD_ENV = "TORCHREVIVE_PRELOAD"
AGENT_PID_ENV = "TORCHREVIVE_AGENT_PID"
"""Set by the launcher before the fork server starts, so every warm worker inherits it."""
ORPHAN_EXIT_CODE = 1
DEFAULT_PRELOAD = ("torch", "torch._dynamo")
_PR_SET_NAME = 15  # prctl(2): set the calling thread's name, which is the process name for the main thread


def preload_modules(environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """Modules the fork server imports, from TORCHREVIVE_PRELOAD (comma-separated;
    empty: no warm start). Raises `UsageError` naming a module that cannot be found,
    since the fork server itself would skip it silently."""
    raw = environ.get(PRELOAD_ENV)
    if raw is None:
        return DEFAULT_PRELOAD
    modules = tuple(name.strip() for name in raw.split(",") if name.strip())
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise UsageError(f"{PRELOAD_ENV} names {name!r}, which is not an importable module")
    return modules


def _prepare_worker(path_entry: str) -> None:
    sys.path.insert(0, path_entry)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True, write_through=True)  # as `python -u`
    name_process(os.environ.get("RANK"))
    agent = os.environ.get(AGENT_PID_ENV, "")
    if agent.isdigit():
        exit_with_agent(int(agent))


def exit_with_agent(agent_pid: int) -> threading.Thread | None:
    """End this process (status 1, one line on stderr) as soon as `agent_pid` exits.
    Returns the watching thread, or None where pidfds are missing (not Linux >= 5.3)."""
    try:
        pidfd = os.pidfd_open(agent_pid)
    except (AttributeError, OSError):
        return None  # no pidfd support, or the agent is already gone (then torch stops us)

    def watch() -> None:
        select.select([pidfd], [], [])  # readable once the agent has exited
        print(
            f"warm worker {os.getpid()}: its torchrun agent (pid {agent_pid}) is gone; exiting",
            file=sys.stderr, flush=True,
        )
        os._exit(ORPHAN_EXIT_CODE)

    thread = threading.Thread(target=watch, name="elastic-agent-watch", daemon=True)
    thread.start()
    return thread


def name_process(rank: str | None) -> None:
    """Name this process `python-rank<RANK>` (best effort: Linux only, 15 bytes)."""
    if rank is None or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, f"python-rank{rank}".encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass  # a name is a convenience, never a reason to fail


def run_script(script: str, *script_args: str) -> None:
    """Run `script` in this (forked) interpreter as `python -u script *script_args` would."""
    sys.argv = [script, *script_args]
    _prepare_worker(os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def run_module(module: str, *script_args: str) -> None:
    """Run `module` in this (forked) interpreter as `python -u -m module *script_args` would."""
    sys.argv = [module, *script_args]
    _prepare_worker(os.getcwd())
    runpy.run_module(module, run_name="__main__", alter_sys=True)
