"""SIGTERM with a bounded grace: a worker that cannot reach a step boundary still exits fast.

Timing here is ordered by handshakes, not sleeps: the worker prints when it is
ready and when it has seen a signal. What remains of wall-clock bounds is either
logically required (nothing exits before its grace) or far enough away that only
a broken handler reaches it (a grace of 600 s, a default grace of 15 s).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from elastic._worker.control.preemption import DEFAULT_GRACE_SECONDS

PRELUDE = (
    "import os, sys, time\n"
    "from elastic._worker.runtime.context import worker_context\n"
    "from elastic._worker.control.preemption import PreemptionHandler\n"
    "ctx_manager = worker_context('cpu')\n"
    "ctx = ctx_manager.__enter__()\n"
    "handler = PreemptionHandler(ctx, grace={grace!r})\n"
    "print('ready', flush=True)\n"
)
WAIT_FOR_THE_SIGNAL = (
    "while not handler.signalled:\n"
    "    time.sleep(0.01)\n"
    "print('signalled', flush=True)\n"
)


def expect_line(proc: subprocess.Popen, want: str) -> None:
    line = proc.stdout.readline().strip()
    if line != want:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"expected {want!r} from the worker, got {line!r}\n{stdout}\n{stderr}")


@contextmanager
def worker(body: str, *, grace: float) -> Iterator[subprocess.Popen]:
    """A worker process with a PreemptionHandler of `grace` seconds installed, running `body`;
    killed at the end if the test left it running."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen([sys.executable, "-c", PRELUDE.format(grace=grace) + body], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        expect_line(proc, "ready")
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_blocked_worker_exits_143_after_the_grace() -> None:
    grace = 1.0
    with worker("r, w = os.pipe()\nos.read(r, 1)  # blocked for good, like a collective with a dead peer\n",
                grace=grace) as proc:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    # The grace it was given (not the default's): that it waits the grace out and no less is
    # tests/unit/test_preemption_watcher.py's, on a clock of the test's.
    assert f"no step ended within {grace:g} s" in stderr and grace != DEFAULT_GRACE_SECONDS


def test_step_boundary_within_the_grace_lets_the_checkpoint_take_its_time() -> None:
    # The worker must vote (requested()) within the grace: it takes milliseconds, the 3 s grace
    # is the margin for a loaded machine. The checkpoint outlasts the grace by a second, so a
    # handler that still counted the grace after the vote would end the worker in the middle of it.
    grace = 3.0
    body = WAIT_FOR_THE_SIGNAL + (
        "assert handler.requested()\n"
        f"time.sleep({grace + 1.0})  # the preemption checkpoint, longer than the grace\n"
        "handler.uninstall()\n"
        "print('checkpointed', flush=True)\n"
    )
    with worker(body, grace=grace) as proc:
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert stdout.split() == ["signalled", "checkpointed"], stdout + stderr


def test_second_sigterm_exits_at_once() -> None:
    # A grace of 600 s: after the first signal only the second one can end this worker before
    # communicate() gives up at 60 s, so "at once" needs no sub-second bound.
    with worker(WAIT_FOR_THE_SIGNAL + "time.sleep(600)\n", grace=600.0) as proc:
        proc.send_signal(signal.SIGTERM)
        # The first signal has been handled before the second is sent, so the kernel cannot
        # merge the two into one pending signal.
        expect_line(proc, "signalled")
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)  # the grace is 600 s: only the second signal ends it by then
    assert proc.returncode in (143, -signal.SIGTERM), stderr
    assert "no step ended" not in stderr  # not the grace running out


def test_a_second_sigterm_ends_a_worker_whose_main_thread_is_stuck_in_native_code() -> None:
    # The main thread blocks SIGTERM and sleeps in C: Python's own handler cannot run
    # there (as in a collective with a dead peer). Only the watcher thread sees the
    # signals; with a 600 s grace, only the second signal can end the worker in time.
    body = (
        "import signal\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"
        "print('blocked', flush=True)\n"
        "time.sleep(600)\n"
    )
    with worker(body, grace=600) as proc:
        expect_line(proc, "blocked")
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # two separate deliveries, not one merged pending signal
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
