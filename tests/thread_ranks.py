"""Ranks as threads of one process, for tests of what ranks agree on (votes, agreements, decisions).

Each thread gets a gloo group of its own on one in-process store, and the `WorkerContext` a worker
of that rank would have; the code under test is handed that group (`group=`) instead of using the
process-global default and control groups. No interpreter is started and torch is imported once,
so such a test costs milliseconds where a job of processes costs seconds of CPU per rank. The gloo
groups talk over loopback sockets, so these tests sit in the integration tier.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from elastic._worker.runtime.context import WorkerContext

T = TypeVar("T")
_groups = itertools.count()


def run_ranks(world_size: int, body: Callable[[WorkerContext, Any], T], *, timeout: float = 60.0) -> list[T]:
    """`body(ctx, group)` on `world_size` threads, one per rank; the results by rank. A rank that
    raised fails the call with its error; one still running after `timeout` seconds fails it too."""
    store = dist.PrefixStore(f"thread-ranks-{next(_groups)}", dist.HashStore())
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def rank_thread(rank: int) -> None:
        try:
            group = dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout))
            ctx = WorkerContext(
                rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size, restart_count=0,
                run_id="threads", device=torch.device("cpu"), backend="gloo",
            )
            results[rank] = body(ctx, group)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller's thread
            errors[rank] = exc

    threads = [threading.Thread(target=rank_thread, args=(rank,), name=f"rank{rank}", daemon=True)
               for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    stuck = [thread.name for thread in threads if thread.is_alive()]
    if stuck:
        raise AssertionError(f"ranks still running after {timeout} s: {', '.join(stuck)}")
    for rank, error in enumerate(errors):
        if error is not None:
            raise AssertionError(f"rank {rank} failed: {type(error).__name__}: {error}") from error
    return results
