"""Ranks of a test's job as processes: forked from a fork server, never from the test's own process.

A test process has threads (xdist's, the servers of earlier tests, torch's pools). A child forked while
one of them held a lock inherits it held: a rank forked from the test process aborted inside FSDP2's
`fully_shard` ("Fatal Python error: Aborted", 1 full suite in 3). multiprocessing's fork server is a
process of one thread that has imported torch once (per test process): ranks forked from it start as
fast as forked ones did, and safely.

Invariant: a rank runs with the environment the test process had when `run_ranks` was called (a fork
server's children would otherwise inherit the fork server's, from when it started).
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed"]


def _in_environment(rank: int, target: Callable[..., None], environ: dict[str, str], *args: Any) -> None:
    os.environ.clear()
    os.environ.update(environ)
    target(rank, *args)


def run_ranks(target: Callable[..., None], nprocs: int, *args: Any, timeout: float = 120, what: str = "") -> None:
    """`target(rank, *args)` for each rank in `nprocs` processes, all ended (each exit 0) within `timeout`
    seconds; else the test fails, the ranks killed. `target` is a module-level function (it is pickled)."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # (only until the fork server has started)
    ranks = mp.start_processes(_in_environment, args=(target, dict(os.environ), *args), nprocs=nprocs, join=False,
                               start_method="forkserver")
    deadline = time.monotonic() + timeout
    while not ranks.join(timeout=0.5):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"{what or target.__name__} on {nprocs} ranks did not finish within {timeout:g} s")
