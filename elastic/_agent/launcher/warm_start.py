"""Warm worker starts: workers forked from a process that has already imported torch.

torchrun starts every worker as a fresh `python -u script.py`, which imports
torch before it can do anything else: 1 to 3 s on a small CPU, more when the
workers of a node start together. A restart pays it again, on the critical path
of every recovery. `elastic._agent.launcher` instead starts workers with torch's own
`--start-method=forkserver` and `--run-path`: multiprocessing's fork server
imports the modules named in `TORCHREVIVE_PRELOAD` (default: torch and
torch._dynamo, which the first optimizer step imports, another 1-2 s) once per
agent, and each worker of every round is a fork of that warm process. torch
runs this file in the worker (`--run-path`), and this file runs the training
script or module named in `TORCHREVIVE_WARM_TARGET`.

Invariants:
- The fork server only imports modules: it never initialises CUDA or joins a
  process group, so a forked worker is as clean as a fresh interpreter as far
  as devices and collectives go. torch and torch._dynamo do not touch the GPU
  at import (torch initialises CUDA lazily). A preloaded module that does
  (torch's lazy CUDA init, or a device count or init call into the driver,
  after which a forked child's CUDA is broken) is caught in the fork server,
  which checks after each import: the agent then starts no forked worker but
  starts every worker cold, as torchrun does, with one warning line naming the
  module. The fork server imports this module (see `configure`), which does
  the preload (warm_preload.py) and keeps its `PreloadReport` for the agent to ask for.
- The script runs as `python -u SCRIPT ARGS` would run it: `sys.argv`; the
  script's folder (or, for a module, the working directory) first on
  `sys.path` in place of the agent's; `__name__ == "__main__"`; line-buffered
  stdout and stderr; atexit handlers run at the end, after an exception too;
  no multiprocessing start method chosen yet; thread pools sized and random
  generators seeded as a fresh start's (`warm_env`); a session of its own, so a
  terminal's Ctrl-C or hangup reaches the agent, not the workers; and its exit
  status: `sys.exit()` and `sys.exit(0)` succeed, `sys.exit(N)` fails with N,
  an uncaught exception with 1 and an uncaught KeyboardInterrupt by SIGINT.
  Differences that remain: stdin is /dev/null (as in any multiprocessing
  child), the workers of an agent share one hash seed, and a script that ends with `os._exit(0)` is never seen as done
  (torch's multiprocessing context waits for a return value): turn warm starts
  off for such a script.
- A worker does not outlive its agent. torchrun's own workers, started in
  sessions of their own, run on as orphans when their agent is killed (OOM
  killer, node drain), holding their peers in collectives until a timeout.
  Warm ones would too: the fork server outlives the agent while its workers
  live. A thread of each warm worker waits on the agent (a pidfd, no polling)
  and ends the worker with one line when the agent is gone; it is an
  `elastic._shared.common.threads` one, which the worker's exit wakes (a pipe) and joins.
- The fork server's objects (the preload's) are frozen out of the garbage
  collector before the first fork: a worker's full collections walk only what
  it made itself, not the 300,000 objects of torch's import (0.4 s each).
- Each worker's process name (`/proc/PID/comm`, what `top` and `ps -o comm`
  show) is `python-rank<RANK>`: forked workers share the fork server's command
  line and initial environment, so this is how to tell them apart.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib.util
import multiprocessing
import os
import runpy
import select
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection

from elastic._agent.launcher import warm_env
from elastic._agent.launcher.warm_preload import PreloadReport, import_preload
from elastic._shared.common import threads
from elastic._shared.common.errors import UsageError
from elastic._shared.slurm.requeue import ignore_in_helper

PRELOAD_ENV = "TORCHREVIVE_PRELOAD"
DEFAULT_PRELOAD = ("torch", "torch._dynamo", "elastic._worker.run.run")
# TARGET_ENV, AGENT_PID_ENV and FORK_SERVER_PRELOAD_ENV are internal plumbing (settings.INTERNAL):
# the agent sets them for its fork server. PRELOAD_ENV is a setting: torchrevive-run's --preload.
TARGET_ENV = "TORCHREVIVE_WARM_TARGET"
"""What a warm worker runs: `script:/abs/path.py` or `module:package.name`."""
AGENT_PID_ENV = "TORCHREVIVE_AGENT_PID"
"""Set by the launcher before the fork server starts, so every warm worker inherits it."""
FORK_SERVER_PRELOAD_ENV = "TORCHREVIVE_FORK_SERVER_PRELOAD"
"""The modules for the fork server to import, set by the agent only while the fork server
starts; the fork server takes it out of its environment, so no worker sees it."""
ORPHAN_EXIT_CODE = 1


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
    forked worker (`--run-path`), which then runs the user's script or module.

    Starts the fork server and waits for its preload (which the first worker
    would wait for anyway). If a preloaded module initialised CUDA there, or
    the preload could not be checked, the arguments stay torchrun's cold start
    and one warning line says why; a forked worker could not have used the GPU.
    """
    target = f"module:{args.training_script}" if args.module else f"script:{os.path.abspath(args.training_script)}"
    os.environ[TARGET_ENV] = target  # inherited by the fork server and its workers
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    warm_env.settle_thread_defaults(args)  # the fork server's thread pools sized as the workers' own
    report = start_fork_server(preload)
    if report is None or report.cuda_by is not None:
        _stop_fork_server()  # it may hold a CUDA context on a GPU the workers need
        os.environ.pop(TARGET_ENV, None)
        os.environ.pop(AGENT_PID_ENV, None)
        if args.start_method is None:
            args.start_method = "spawn"  # torch's default
        return
    args.start_method = "forkserver"
    args.run_path = True
    args.module = False
    args.training_script = os.path.abspath(__file__)


def start_fork_server(preload: Sequence[str]) -> PreloadReport | None:
    """Start multiprocessing's fork server, have it import `preload` (see `import_preload`),
    and return its report: None when it could not be had. Each problem is one warning line
    on stderr, saying what the launcher does about it."""
    os.environ[FORK_SERVER_PRELOAD_ENV] = ",".join(preload)
    multiprocessing.set_forkserver_preload([__name__])  # this module: its import does the preload
    try:
        report = _ask_fork_server()
    except (OSError, EOFError) as exc:
        _warn(
            f"the fork server ended before it could start workers ({type(exc).__name__}: {exc}), "
            f"perhaps ended by a {PRELOAD_ENV} module; starting workers cold"
        )
        return None
    finally:
        os.environ.pop(FORK_SERVER_PRELOAD_ENV, None)
    if report is None:
        _warn(f"the fork server could not import {__name__} to preload {PRELOAD_ENV}; starting workers cold")
        return None
    for name, error in report.failed:
        _warn(f"{PRELOAD_ENV} module {name!r} failed to import in the fork server ({error}); the workers import it themselves")
    if report.cuda_by is not None:
        _warn(
            f"{PRELOAD_ENV} module {report.cuda_by!r} initialised CUDA in the fork server, so forked workers "
            f"could not use the GPU; starting workers cold instead: drop {report.cuda_by!r} from "
            f"{PRELOAD_ENV} or import it in the training script"
        )
    return report


def _warn(line: str) -> None:
    print(f"torchrevive-run: warning: {line}", file=sys.stderr, flush=True)


def _ask_fork_server() -> PreloadReport | None:
    """A child of the fork server (started as torch starts workers) sends back the report it inherited."""
    context = multiprocessing.get_context("forkserver")
    receiver, sender = context.Pipe(duplex=False)
    probe = context.Process(target=_send_report, args=(sender,), name="torchrevive-preload-check", daemon=True)
    try:
        probe.start()
        sender.close()
        return receiver.recv()
    finally:
        receiver.close()
        if probe.pid is not None:
            probe.join()


def _send_report(connection: Connection) -> None:
    report = _fork_server_report
    connection.send(report if report is not None and report.pid == os.getppid() else None)
    connection.close()


def _stop_fork_server() -> None:
    """Stop multiprocessing's fork server if it runs (best effort: a private API of the stdlib)."""
    from multiprocessing import forkserver

    try:
        forkserver._forkserver._stop()  # type: ignore[attr-defined]
    except (AttributeError, OSError, ChildProcessError):
        pass


def exit_with_agent(agent_pid: int) -> threading.Thread | None:
    """End this process (status 1, one line on stderr) as soon as `agent_pid` exits.
    Returns the watching thread, or None where pidfds are missing (not Linux >= 5.3)."""
    try:
        pidfd = os.pidfd_open(agent_pid)
    except (AttributeError, OSError):
        return None  # no pidfd support, or the agent is already gone (then torch stops us)

    wake_read, wake_write = os.pipe()

    def stop() -> None:
        os.write(wake_write, b"x")

    def watch() -> None:
        readable, _, _ = select.select([pidfd, wake_read], [], [])  # pidfd: readable once the agent has exited
        if pidfd not in readable:
            return  # this worker is exiting
        print(
            f"warm worker {os.getpid()}: its torchrun agent (pid {agent_pid}) is gone; exiting",
            file=sys.stderr, flush=True,
        )
        os._exit(ORPHAN_EXIT_CODE)

    return threads.start(watch, name="elastic-agent-watch", stop=stop)


def _prepare_worker(path_entry: str) -> None:
    """Make this forked process look like a fresh `python -u` one (see the invariants)."""
    sys.path[0] = path_entry  # the agent's own first entry is no business of the script's
    sys.modules.pop("__mp_main__", None)  # the agent's main module, imported by the fork server's child
    multiprocessing.set_start_method(None, force=True)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True, write_through=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the fork server ignores it; a worker must not
    try:
        os.setsid()
    except OSError:
        pass  # already a session leader
    warm_env.name_process(os.environ.get("RANK"))
    warm_env.fresh_random_streams()  # torch's and numpy's generators, seeded as a new interpreter's are
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
        raise SystemExit(f"{__file__}: {TARGET_ENV} is not set: this file is run by elastic._agent.launcher in its workers")
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


# In the fork server, which imports this module as its preload (see `start_fork_server`):
# import the user's preload here, and keep the report for the agent's probe.
_fork_server_report: PreloadReport | None = None
_fork_server_plan = os.environ.pop(FORK_SERVER_PRELOAD_ENV, None)
if _fork_server_plan is not None and __name__ != "__main__":
    # Slurm signals every process of a step, this one too. Dying of it would make the agent see its
    # workers as gone (their exit statuses come through this process) and leave before they commit.
    # It ends with the agent instead (multiprocessing's fork server exits when the agent's pipe closes).
    ignore_in_helper(os.environ)  # the requeue signal: its workers inherit the SIG_IGN until their run's handler
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # put back to the default in each worker (_prepare_worker)
    _fork_server_report = import_preload([name for name in _fork_server_plan.split(",") if name])
    # Every worker inherits the preload's objects (torch's: hundreds of thousands); its first full
    # collection would walk them all, 0.4 s at a random point of its restore on a small CPU, and
    # write to every page it walks (copying what the fork shared). They live as long as the worker.
    gc.collect()
    gc.freeze()

if __name__ == "__main__":
    main()
