"""The hang watchdog in a real process: a stuck main thread ends it with status 124 and a stack."""

from __future__ import annotations

import subprocess
import sys
import time

from elastic.watchdog import EXIT_CODE


def test_a_stuck_main_thread_ends_the_process_with_124_and_a_stack() -> None:
    script = (
        "import threading\n"
        "from elastic.watchdog import watchdog\n"
        "dog = watchdog(0.5)\n"
        "dog.beat(7)\n"
        "threading.Event().wait()  # the main thread is stuck, as in a dead collective\n"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - started
    assert done.returncode == EXIT_CODE, done.stderr
    # Not before its 0.5 s (the process started after `started`); the upper bound is only for a
    # watchdog that does not fire at all (which subprocess.run's 60 s would also catch).
    assert 0.5 <= elapsed < 30, elapsed
    first_line = done.stderr.splitlines()[0]
    assert first_line.startswith("watchdog: no training step completed") and "after step 7" in first_line
    assert "Thread" in done.stderr and "wait" in done.stderr  # where it was stuck
