"""Hang detection: the watchdog trips only when steps stop, never before the first one.

The rules are checked against a fake clock that moves only when the test says so,
with `check()` (the look the thread takes every `poll` seconds) called by the test:
no sleeps, no wall-clock bounds. One test shows that the thread really does take
those looks, one that a real stuck process really ends.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from support import wait_for

from elastic._worker.control.watchdog import EXIT_CODE, NoWatchdog, Watchdog, watchdog

TIMEOUT = 8.0  # seconds of fake time; this and every step below are exact in binary floating point
NEVER = 3600.0  # the thread's own poll: it takes no look while a test runs, the test calls check()


class FakeClock:
    """A time source that moves only when told to; counts how often it was read."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@contextmanager
def recording_watchdog(clock: FakeClock, *, poll: float = NEVER) -> Iterator[tuple[Watchdog, list[str]]]:
    trips: list[str] = []
    dog = Watchdog(TIMEOUT, on_trip=trips.append, poll=poll, clock=clock)
    try:
        yield dog, trips
    finally:
        dog.close()


def test_not_armed_before_the_first_step() -> None:
    clock = FakeClock()
    with recording_watchdog(clock) as (dog, trips):
        clock.advance(100 * TIMEOUT)  # restore, compilation: as slow as they like
        assert not dog.check()
        assert trips == [] and not dog.tripped
        dog.beat(1)  # armed from here
        clock.advance(TIMEOUT)
        assert dog.check() and len(trips) == 1


def test_steady_steps_keep_it_quiet() -> None:
    clock = FakeClock()
    with recording_watchdog(clock) as (dog, trips):
        for step in range(1, 21):  # 20 steps of 7 s: far more than the timeout in all
            dog.beat(step)
            clock.advance(TIMEOUT - 1)
            assert not dog.check(), f"tripped at step {step} though every step took less than the timeout"
        assert trips == [] and not dog.tripped


def test_trips_once_when_steps_stop_naming_the_last_step() -> None:
    clock = FakeClock()
    with recording_watchdog(clock) as (dog, trips):
        dog.beat(41)
        dog.beat(42)
        clock.advance(TIMEOUT - 0.5)
        assert not dog.check() and not dog.tripped, "tripped before the timeout"
        clock.advance(0.5)
        assert dog.check() and dog.tripped
        clock.advance(10 * TIMEOUT)
        assert dog.check()  # stays tripped...
        assert len(trips) == 1  # ...and reports once
    assert trips[0].startswith(f"watchdog: no training step completed for {TIMEOUT:.0f} s after step 42 ")
    assert f"(limit {TIMEOUT:g} s)" in trips[0] and f"status {EXIT_CODE}" in trips[0]


def test_paused_blocks_do_not_trip_and_restart_the_clock() -> None:
    clock = FakeClock()
    with recording_watchdog(clock) as (dog, trips):
        dog.beat(1)
        clock.advance(TIMEOUT - 1)
        with dog.paused():  # validation, a final checkpoint flush
            clock.advance(100 * TIMEOUT)
            assert not dog.check(), "tripped inside a paused block"
            with dog.paused():  # nested: still paused after the inner one ends
                pass
            clock.advance(TIMEOUT)
            assert not dog.check(), "tripped inside a paused block after a nested one ended"
        clock.advance(TIMEOUT - 1)  # less than the timeout since the pause ended
        assert not dog.check(), "the clock did not restart when the pause ended"
        assert trips == []
        clock.advance(1)
        assert dog.check() and "after step 1 " in trips[0]


def test_a_pause_before_the_first_step_does_not_arm_it() -> None:
    clock = FakeClock()
    with recording_watchdog(clock) as (dog, trips):
        with dog.paused():  # e.g. a validation pass before training starts
            clock.advance(TIMEOUT)
        clock.advance(100 * TIMEOUT)
        assert not dog.check() and trips == []


def test_the_thread_looks_by_itself_and_trips_when_time_is_up() -> None:
    clock = FakeClock()
    tripped = threading.Event()
    trips: list[str] = []

    def on_trip(message: str) -> None:
        trips.append(message)
        tripped.set()

    dog = Watchdog(TIMEOUT, on_trip=on_trip, poll=0.005, clock=clock)
    try:
        dog.beat(5)
        reads = clock.reads
        # The thread reads the clock on each look once armed: three looks, none past the limit.
        wait_for(lambda: clock.reads >= reads + 3, 60, "the watchdog thread to look at the clock", interval=0.001)
        assert not tripped.is_set() and trips == []
        clock.advance(TIMEOUT)
        assert tripped.wait(60), "the thread did not trip within 60 s of real time after the timeout had passed"
    finally:
        dog.close()
    assert not dog._thread.is_alive()
    assert len(trips) == 1 and "after step 5 " in trips[0]


def test_zero_timeout_means_no_watchdog() -> None:
    off = watchdog(0)
    assert isinstance(off, NoWatchdog)
    off.beat(1)
    with off.paused():
        pass
    off.close()
