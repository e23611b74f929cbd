"""The preemption watcher's grace on a clock of the test's: a worker blocked after SIGTERM is ended
once the grace has passed, never before (tests/integration/test_preemption_grace.py: in a process)."""

from __future__ import annotations

import signal
import socket
import threading

import pytest
import torch

from elastic._worker.control import preemption
from elastic._worker.control.preemption import PreemptionHandler
from elastic._worker.runtime.context import WorkerContext


class Exited(Exception):
    pass


def test_a_blocked_worker_is_ended_once_the_grace_has_passed_and_not_before(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = WorkerContext(rank=0, local_rank=0, world_size=1, local_world_size=1, restart_count=0, run_id="t",
                        device=torch.device("cpu"), backend=None)
    made: list[PreemptionHandler] = []
    maker = threading.Thread(target=lambda: made.append(PreemptionHandler(ctx, grace=5.0)))  # off the main thread: no handler installed
    maker.start()
    maker.join()
    now = [100.0]

    def tick() -> float:
        now[0] += 0.5  # every look at the clock: half a second later
        return now[0]

    def exit_process(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(preemption.time, "monotonic", tick)
    monkeypatch.setattr(preemption.os, "_exit", exit_process)
    reader, writer = socket.socketpair()
    with reader, writer:
        writer.send(bytes([signal.SIGTERM]))  # what the signal's wakeup fd receives
        with pytest.raises(Exited) as exited:
            made[0]._watch(reader)
    assert exited.value.args == (128 + signal.SIGTERM,)
    # The grace starts at the look that saw the signal (100.5): no exit before 105.5.
    assert now[0] >= 100.5 + 5.0
