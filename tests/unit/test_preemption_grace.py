"""SIGTERM with a bounded grace: a worker that cannot reach a step boundary still exits fast."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

PRELUDE = (
    "import os, sys, time\n"
    "from elastic.runtime import worker_context\n"
    "from elastic.preemption import PreemptionHandler\n"
    "ctx_manager = worker_context('cpu')\n"
    "ctx = ctx_manager.__enter__()\n"
    "handler = PreemptionHandler(ctx, grace=1.0)\n"
    "print('ready', flush=True)\n"
)


def start(body: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen([sys.executable, "-c", PRELUDE + body], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_blocked_worker_exits_143_after_the_grace() -> None:
    proc = start("r, w = os.pipe()\nos.read(r, 1)  # blocked for good, like a collective with a dead peer\n")
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 143
    assert 0.9 <= time.monotonic() - started < 15
    assert "no step ended within 1 s" in stderr


def test_step_boundary_within_the_grace_lets_the_checkpoint_take_its_time() -> None:
    body = (
        "while not handler.signalled:\n"
        "    time.sleep(0.01)\n"
        "assert handler.requested()\n"
        "time.sleep(2.5)  # the preemption checkpoint, longer than the grace\n"
        "handler.uninstall()\n"
        "print('checkpointed', flush=True)\n"
    )
    proc = start(body)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert "checkpointed" in stdout


def test_second_sigterm_exits_at_once() -> None:
    proc = start("time.sleep(60)\n")
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode in (143, -signal.SIGTERM)
    assert time.monotonic() - started < 0.9  # well before the 1 s grace
