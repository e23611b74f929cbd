"""What a warm worker takes from its own start, as a cold one would (a part of `warm_start`).

A cold worker is a fresh `python -u script.py`: the libraries it loads size their thread
pools from the environment it starts with (torch's intra-op threads and the OpenMP runtime
from OMP_NUM_THREADS and MKL_NUM_THREADS, MKL's pool, numpy's OpenBLAS), and its random
generators are seeded afresh from the OS. A warm worker is a fork of the fork server, where
those libraries were loaded, sized and seeded once, before any worker existed.

Invariants:
- The fork server starts with the thread variables its workers get. torchrun sets
  OMP_NUM_THREADS=1 for every worker when `--nproc-per-node` > 1 and the user chose none,
  but inside torch's `run`, after the fork server has started (and sized every pool for
  all the cores: measured, 2 threads a worker instead of 1 and a step 7x slower with 2
  workers on 2 cores). `settle_thread_defaults` makes the same choice first, in the agent,
  with torchrun's own rule and its message; torch then passes that value to every worker.
  Nothing is set when the user chose (the variable is in the environment) or when one
  worker runs per node.
- `fresh_random_streams` runs in each warm worker: torch's CPU generator and numpy's global
  one are seeded from the OS, as a new interpreter's are (Python's `random` reseeds itself
  in a forked child). CUDA's generators are not touched: the fork server never initialises
  CUDA, and their default seed is the same fixed value in a cold worker.
- What stays shared by the warm workers of one agent: the hash seed of `str` and `bytes`
  (chosen once per interpreter; PYTHONHASHSEED fixes it for cold workers too).

Process names (`name_process`) are here too: a worker's start, not the fork server's.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from collections.abc import MutableMapping

from elastic._agent.launcher.proctree import WARM_WORKER_NAME


THREADS_ENV = "OMP_NUM_THREADS"
TORCHRUN_THREADS_DEFAULT = "1"
"""What torchrun gives every worker when several run on a node (torch.distributed.run.config_from_args)."""
_PR_SET_NAME = 15  # prctl(2): set the calling thread's name, which is the process name for the main thread


def workers_per_node(args: argparse.Namespace) -> int | None:
    """`--nproc-per-node` as torchrun reads it (a number, cpu, gpu or auto); None when it cannot be read
    (torchrun reports that itself)."""
    from torch.distributed.run import determine_local_world_size

    try:
        return int(determine_local_world_size(args.nproc_per_node))
    except (ValueError, TypeError):
        return None


def settle_thread_defaults(args: argparse.Namespace, environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Set OMP_NUM_THREADS in `environ` as torchrun is about to (see the module docstring), before the fork
    server starts; returns the value set, None when nothing was (the user's choice, or one worker a node)."""
    if THREADS_ENV in environ:
        return None
    workers = workers_per_node(args)
    if workers is None or workers <= 1:
        return None
    environ[THREADS_ENV] = TORCHRUN_THREADS_DEFAULT
    print(
        f"torchrevive-run: {THREADS_ENV}={TORCHRUN_THREADS_DEFAULT} for each of the {workers} workers of this node, "
        f"as torchrun sets it (export {THREADS_ENV} to choose another); the warm workers' fork server uses it too",
        file=sys.stderr, flush=True,
    )
    return TORCHRUN_THREADS_DEFAULT


def fresh_random_streams() -> None:
    """Seed torch's CPU generator and numpy's global one from the OS, as a fresh interpreter does;
    only those the fork server loaded (a module the worker imports itself seeds itself)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def name_process(rank: str | None) -> None:
    """Name this process `python-rank<RANK>` (best effort: Linux only, 15 bytes)."""
    if rank is None or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, f"{WARM_WORKER_NAME}{rank}".encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass  # a name is a convenience, never a reason to fail
