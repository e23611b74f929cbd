"""Warm worker starts: workers forked from a process that has already imported torch.

torchrun starts every worker as a fresh `python -u script.py`, which imports
torch before it can do anything else: 1 to 3 s on a small CPU, more when the
workers of a node start together. A restart pays it again, on the critical path
of every recovery. `elastic.launcher` instead starts workers with torch's own
`--start-method=forkserver` and `--run-path`: multiprocessing's fork server
imports the modules named in `TORCHREVIVE_PRELOAD` (default: torch and
torch._dynamo, which the first optimizer step imports, another 1-2 s) once per
agent, and each worker of every round is a fork of that warm process. torch
runs this file in the worker (`--run-path`), and this file runs the training
script or module named in `TORCHREVIVE_WARM_TARGET`.

Invariants:
- The fork server only imports modules: it never initialises CUDA or joins a
  process group, so a forked worker is as clean as a fresh interpreter as far
  as devices and collectives go. Modules that probe the GPU at import must not
  be preloaded; torch and torch._dynamo do not (torch initialises CUDA lazily).
- The script runs as `python -u SCRIPT ARGS` would run it: `sys.argv`; the
  script's folder (or, for a module, the working directory) first on
  `sys.path` in place of the agent's; `__name__ == "__main__"`; line-buffered
  stdout and stderr; atexit handlers run at the end, after an exception too;
  no multiprocessing start method chosen yet; a session of its own, so a
  terminal's Ctrl-C or hangup reaches the agent, not the workers; and its exit
  status: `sys.exit()` and `sys.exit(0)` succeed, `sys.exit(N)` fails with N,
  an uncaught exception with 1 and an uncaught KeyboardInterrupt by SIGINT.
  Differences that remain: stdin is /dev/null (as in any multiprocessing
  child), and a script that ends with `os._exit(0)` is never seen as done
  (torch's multiprocessing context waits for a return value): turn warm starts
  off for such a script.
- A worker does not outlive its agent. torchrun's own workers, started in
  sessions of their own, run on as orphans when their agent is killed (OOM
  killer, node drain), holding their peers in collectives until a timeout.
  Warm ones would too: the fork server outlives the agent while its workers
  live. A thread of each warm worker waits on the agent (a pidfd, no polling)
  and ends the worker with one line when the agent is gone.
- Each worker's process name (`/proc/PID/comm`, what `top` and `ps -o comm`
  show) is `python-rank<RANK>`: forked workers share the fork server's command
  line and initial environment, so this is how to tell them apart.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import importlib.util
import multiprocessing
import os
import runpy
import select
import signal
import sys
import threading
from collections.abc import Mapping

from elastic.errors import UsageError
from elastic.launcher.proctree import WARM_WORKER_NAME

PRELOAD_ENV = "TORCHREVIVE_PRELOAD"
DEFAULT_PRELOAD = ("torch", "torch._dynamo")
TARGET_ENV = "TORCHREVIVE_WARM_TARGET"
"""What a warm worker runs: `script:/abs/path.py` or `module:package.name`."""
AGENT_PID_ENV = "TORCHREVIVE_AGENT_PID"
"""Set by the launcher before the fork server starts, so every warm worker inherits it."""
ORPHAN_EXIT_CODE = 1
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


def applies(args: argparse.Namespace, preload: tuple[str, ...], environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a torchrun command line (torch's parsed arguments, `start_method`
    None when not chosen) gets warm workers: not for `--no-python`, another
    `--start-method` than forkserver, a `PYTHON_EXEC` interpreter, or no preload."""
    return (
        bool(preload)
        and not args.no_python
        and args.start_method in (None, "forkserver")
        and not environ.get("PYTHON_EXEC")
    )


def configure(args: argparse.Namespace, preload: tuple[str, ...]) -> None:
    """Turn torchrun's arguments into a warm start: torch runs this file in each
    forked worker (`--run-path`), which then runs the user's script or module."""
    target = f"module:{args.training_script}" if args.module else f"script:{os.path.abspath(args.training_script)}"
    os.environ[TARGET_ENV] = target  # inherited by the fork server and its workers
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    args.start_method = "forkserver"
    args.run_path = True
    args.module = False
    args.training_script = os.path.abspath(__file__)
    multiprocessing.set_forkserver_preload(list(preload))


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
        libc.prctl(_PR_SET_NAME, f"{WARM_WORKER_NAME}{rank}".encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass  # a name is a convenience, never a reason to fail


def _prepare_worker(path_entry: str) -> None:
    """Make this forked process look like a fresh `python -u` one (see the invariants)."""
    sys.path[0] = path_entry  # the agent's own first entry is no business of the script's
    sys.modules.pop("__mp_main__", None)  # the agent's main module, imported by the fork server's child
    multiprocessing.set_start_method(None, force=True)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True, write_through=True)
    try:
        os.setsid()
    except OSError:
        pass  # already a session leader
    name_process(os.environ.get("RANK"))
    agent = os.environ.get(AGENT_PID_ENV, "")
    if agent.isdigit():
        exit_with_agent(int(agent))


def _run_target(kind: str, target: str) -> None:
    if kind == "module":
        _prepare_worker(os.getcwd())
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        _prepare_worker(os.path.dirname(target))
        runpy.run_path(target, run_name="__main__")


def main() -> None:
    """Run in a warm worker by torch's `--run-path` entry point, with sys.argv =
    [this file, *script arguments]: run the target as `python -u` would."""
    kind, _, target = os.environ.pop(TARGET_ENV, "").partition(":")
    if kind not in ("script", "module") or not target:
        raise SystemExit(f"{__file__}: {TARGET_ENV} is not set: this file is run by elastic.launcher in its workers")
    sys.argv = [target, *sys.argv[1:]]
    try:
        _run_target(kind, target)
    except SystemExit as exc:
        atexit._run_exitfuncs()
        if exc.code not in (None, 0):
            raise
    except KeyboardInterrupt:
        atexit._run_exitfuncs()
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # die by SIGINT, as python does
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        atexit._run_exitfuncs()
        raise
    else:
        atexit._run_exitfuncs()


if __name__ == "__main__":
    main()
