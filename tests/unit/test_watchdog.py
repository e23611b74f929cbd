"""Hang detection: the watchdog trips only when steps stop, never before the first one."""

from __future__ import annotations

import subprocess
import sys
import time

from elastic.watchdog import EXIT_CODE, NoWatchdog, Watchdog, watchdog


def recording_watchdog(timeout: float) -> tuple[Watchdog, list[str]]:
    trips: list[str] = []
    return Watchdog(timeout, on_trip=trips.append, poll=0.01), trips


def test_not_armed_before_the_first_step() -> None:
    dog, trips = recording_watchdog(0.1)
    time.sleep(0.3)  # restore, compilation: as slow as they like
    dog.close()
    assert trips == [] and not dog.tripped


def test_steady_steps_keep_it_quiet() -> None:
    dog, trips = recording_watchdog(0.2)
    for step in range(1, 15):
        dog.beat(step)
        time.sleep(0.02)
    dog.close()
    assert trips == []


def test_trips_once_when_steps_stop_naming_the_last_step() -> None:
    dog, trips = recording_watchdog(0.15)
    dog.beat(41)
    dog.beat(42)
    time.sleep(0.5)
    dog.close()
    assert dog.tripped and len(trips) == 1
    assert "after step 42" in trips[0] and f"status {EXIT_CODE}" in trips[0]


def test_paused_blocks_do_not_trip_and_restart_the_clock() -> None:
    dog, trips = recording_watchdog(0.15)
    dog.beat(1)
    with dog.paused():
        time.sleep(0.4)  # validation, a final checkpoint flush
    time.sleep(0.05)  # less than the timeout since the pause ended
    dog.close()
    assert trips == []


def test_zero_timeout_means_no_watchdog() -> None:
    off = watchdog(0)
    assert isinstance(off, NoWatchdog)
    off.beat(1)
    with off.paused():
        pass
    off.close()


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
    assert done.returncode == EXIT_CODE
    assert time.monotonic() - started < 30
    first_line = done.stderr.splitlines()[0]
    assert first_line.startswith("watchdog: no training step completed") and "after step 7" in first_line
    assert "Thread" in done.stderr and "wait" in done.stderr  # where it was stuck
