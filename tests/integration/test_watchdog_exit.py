"""The hang watchdog in a real process: a stuck main thread ends it with status 124 and a stack."""

from __future__ import annotations

import sys

import warm

from elastic._worker.control.watchdog import EXIT_CODE


def test_a_stuck_main_thread_ends_the_process_with_124_and_a_stack() -> None:
    script = (
        "import threading\n"
        "from elastic._worker.control.watchdog import watchdog\n"
        "dog = watchdog(0.5)\n"
        "dog.beat(7)\n"
        "threading.Event().wait()  # the main thread is stuck, as in a dead collective\n"
    )
    done = warm.run([sys.executable, "-c", script], timeout=60)
    assert done.returncode == EXIT_CODE, done.stderr
    first_line = done.stderr.splitlines()[0]
    assert first_line.startswith("watchdog: no training step completed") and "after step 7" in first_line
    # Its own limit, not another path's (that it never trips before the limit: tests/unit/test_watchdog.py's clock).
    assert "(limit 0.5 s)" in first_line, first_line
    assert "Thread" in done.stderr and "wait" in done.stderr  # where it was stuck
