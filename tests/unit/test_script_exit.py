"""The end of a module-level script's run (elastic._worker.run.script_exit), in one process: what the
exit hook leaves with, and that a run already closed leaves python's own report alone."""

from __future__ import annotations

from elastic._shared.common.errors import UsageError
from elastic._worker.run.script_exit import ScriptExit


def test_the_exit_leaves_once_with_the_exception_that_ended_the_script() -> None:
    left, reported = [], []
    script_exit = ScriptExit(lambda *exc: left.append(exc))
    hook = script_exit.excepthook(lambda *exc: reported.append(exc))
    error = ZeroDivisionError("a bug of the script")
    hook(ZeroDivisionError, error, None)
    assert reported == [(ZeroDivisionError, error, None)]  # a bug keeps python's traceback
    script_exit.at_exit()
    script_exit.at_exit()  # once only
    assert left == [(ZeroDivisionError, error, None)]


def test_a_clean_end_leaves_without_an_exception() -> None:
    left = []
    ScriptExit(lambda *exc: left.append(exc)).at_exit()
    assert left == [(None, None, None)]


def test_after_close_a_library_error_is_reported_by_python_as_without_a_run() -> None:
    left, reported = [], []
    script_exit = ScriptExit(lambda *exc: left.append(exc))
    hook = script_exit.excepthook(lambda *exc: reported.append(exc))
    script_exit.pending = False  # what Run.close does (uninstall), without touching atexit here
    error = UsageError("raised after run.close()")
    hook(UsageError, error, None)
    assert reported == [(UsageError, error, None)]  # not swallowed
    script_exit.at_exit()
    assert left == []
