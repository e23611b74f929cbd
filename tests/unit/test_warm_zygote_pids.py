"""tests/warm.py's bookkeeping of the zygote's programs: a reused pid never reads an old program's exit status.

The suite forks thousands of programs and threads, and on a machine whose pid_max is 32,768 the
kernel hands a pid out again within one run: a program that ended long before may have had the pid
of a new one. Before the fix, the new program "exited" at once with the old one's status (the cifar
tests on a fresh machine: a recipe that "exited 0 with no output", agents that "exited 2 with empty
logs", a SIGTERM "answered" with 0)."""

from __future__ import annotations

import threading

import warm


def bookkeeping() -> warm._Zygote:
    """The zygote's client side with no process behind it: the reader's messages are fed by hand."""
    zygote = object.__new__(warm._Zygote)
    zygote._started, zygote._ended, zygote._answers = {}, {}, []
    zygote._changed = threading.Condition()
    return zygote


def test_a_pid_the_kernel_hands_out_again_does_not_carry_the_old_programs_exit_status() -> None:
    zygote = bookkeeping()
    zygote._take({"pid": 4242})  # an early program's fork...
    zygote._answers.pop()
    zygote._take({"pid": 4242, "returncode": 2})  # ...that ended with status 2
    assert zygote.returncode(4242, 0) == 2
    zygote._take({"pid": 4242})  # much later, a new program gets the same pid
    assert zygote.returncode(4242, 0) is None  # running: not the old program's 2
    zygote._take({"pid": 4242, "returncode": -15})
    assert zygote.returncode(4242, 0) == -15


def test_a_program_that_ends_before_its_fork_answer_is_read_keeps_its_status() -> None:
    """The zygote sends the pid first and the exit status after it: both may be taken before `fork`
    reads the answer; the status then stays."""
    zygote = bookkeeping()
    zygote._take({"pid": 7})
    zygote._take({"pid": 7, "returncode": 0})
    assert zygote._answers == [{"pid": 7}] and zygote.returncode(7, 0) == 0
