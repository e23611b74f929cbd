"""The agent's wait between looks at its workers ends the moment one of them dies (death_watch)."""

from __future__ import annotations

import signal
import subprocess
import threading

from elastic._agent.launcher.death_watch import ExitWaiter


def test_a_death_ends_the_wait_and_a_worker_seen_gone_is_not_waited_on_again() -> None:
    sleepers = [subprocess.Popen(["sh", "-c", "exec sleep 120"]) for _ in range(2)]
    doomed, alive = sleepers
    waiter = ExitWaiter()
    try:
        pids = {doomed.pid, alive.pid}
        threading.Timer(0.2, doomed.send_signal, [signal.SIGKILL]).start()
        waiter.wait(pids, timeout=600)  # returns at the death (else the suite's timeout ends the test)
        assert waiter._gone == {doomed.pid}, "the wait ended on the dead worker's descriptor"
        # The dead worker stays unreaped (a zombie: its descriptor readable for good); the next wait
        # must not end on it again, or the agent would spin until its peers finish.
        waiter.wait(pids, timeout=0.05)
        assert waiter._gone == {doomed.pid} and set(waiter._open) == {alive.pid}
        waiter.wait({alive.pid}, timeout=0.01)  # a group started again: the old worker forgotten
        assert waiter._gone == set() and set(waiter._open) == {alive.pid}
    finally:
        waiter.close()
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
    assert waiter._open == {}


def test_a_worker_gone_before_the_look_ends_the_wait_at_once() -> None:
    gone = subprocess.Popen(["sh", "-c", "exit 0"])
    gone.wait()  # reaped: no such process any more
    waiter = ExitWaiter()
    waiter.wait({gone.pid}, timeout=600)
    assert waiter._gone == {gone.pid}


def test_after_a_death_the_look_is_taken_again_until_torch_has_heard_of_it() -> None:
    """A warm worker is the fork server's child: torch hears of its exit a little after it happened."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

    from elastic._agent.launcher.death_watch import look_until_heard

    answers = [RunResult(WorkerState.HEALTHY), RunResult(WorkerState.HEALTHY), RunResult(WorkerState.FAILED)]
    looks = iter(answers)
    assert look_until_heard(lambda: next(looks), died=True).state == WorkerState.FAILED
    looks = iter(answers)
    assert look_until_heard(lambda: next(looks), died=False).state == WorkerState.HEALTHY, "no death: one look"
