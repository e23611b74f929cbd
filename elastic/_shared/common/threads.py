"""The library's threads, and the one rule they keep at interpreter exit.

Why a rule: CPython before 3.14 ends a daemon thread that wants the GIL back
after finalization has begun with `pthread_exit`, a forced unwind of its
stack. A thread inside a torch C++ call that released the GIL (a gloo
collective, a TCPStore wait, `destroy_process_group`, a DCP or `torch.load`
read) takes the GIL back in the destructor of pybind11's `gil_scoped_release`;
the unwind cannot leave that noexcept destructor, so the C++ runtime calls
`std::terminate`: "terminate called without an active exception", SIGABRT,
exit -6, for a process whose work had succeeded (torchrun then restarts it).

Invariant: when the interpreter starts finalizing, no thread started through
`start` is alive. At exit (an atexit hook, so on a normal end, `sys.exit` and
an uncaught exception alike, before finalization) each live one is told to stop
(its `stop` callable) and joined, all within one bound, `EXIT_JOIN_SECONDS`.
A thread still alive past the bound (a read hung in the kernel, a collective
whose peer is gone) can neither be joined nor be left to the unwind: the
process then says so in one stderr line, flushes stdout and stderr and ends
with `os._exit(status)`, which skips finalization, so no thread is unwound.
`status` is the one the process meant to exit with, as far as this module can
know it: the last `note_exit_status` (the library notes one where it abandons a
thread on its way to a known exit, e.g. 75 after a restore timed out), else 1
after an uncaught exception (130 for KeyboardInterrupt), else the status of the
main thread's last `sys.exit` (this module wraps it, since an atexit hook cannot
read it; one a script caught and went on from counts only if nothing crashed
after it), else 1: an exit with a library thread hung is not a success.

A forked child starts with no library threads (fork copies only the forking
thread), so the registry is emptied in the child.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from elastic._shared.timings import EXIT_JOIN_SECONDS


@dataclass(frozen=True)
class _Entry:
    thread: threading.Thread
    stop: Callable[[], None] | None


_lock = threading.Lock()
_entries: list[_Entry] = []
_exit_status: int | None = None
_sys_exit_status: int | None = None


def start(
    target: Callable[..., Any], *, name: str, stop: Callable[[], None] | None = None, args: tuple[Any, ...] = ()
) -> threading.Thread:
    """Start `target(*args)` on a daemon thread named `name` that the exit stops and joins.

    `stop` asks the thread to end soon (set its event, close its socket); None
    for a thread that ends on its own within the bound (an import, a last read).
    The thread stays a daemon, so a forgotten one cannot hang the exit beyond it.
    """
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    with _lock:
        _entries[:] = [e for e in _entries if e.thread.is_alive()]
        _entries.append(_Entry(thread, stop))
    thread.start()
    return thread


def alive() -> list[threading.Thread]:
    """The library threads running now."""
    with _lock:
        return [e.thread for e in _entries if e.thread.is_alive()]


def note_exit_status(status: int) -> None:
    """The status this process exits with if it must end before a library thread does."""
    global _exit_status
    _exit_status = status


def stop_all(timeout: float) -> list[threading.Thread]:
    """Stop every library thread and join them, `timeout` seconds for all; returns those still alive."""
    with _lock:
        entries = list(_entries)
    for entry in entries:
        if entry.stop is not None and entry.thread.is_alive():
            try:
                entry.stop()
            except Exception:  # noqa: BLE001 - a stop that fails leaves its thread to the join's bound
                pass
    deadline = time.monotonic() + timeout
    for entry in entries:
        if entry.thread is not threading.current_thread():
            entry.thread.join(max(0.0, deadline - time.monotonic()))
    return [e.thread for e in entries if e.thread.is_alive() and e.thread is not threading.current_thread()]


def _intended_status() -> int:
    if _exit_status is not None:
        return _exit_status
    crashed = getattr(sys, "last_value", None)  # set by the interpreter for an uncaught exception (not SystemExit)
    if isinstance(crashed, KeyboardInterrupt):
        return 130
    if crashed is not None or _sys_exit_status is None:
        return 1
    return _sys_exit_status


def _at_exit() -> None:
    """The invariant of the module docstring, at interpreter exit."""
    stuck = stop_all(EXIT_JOIN_SECONDS)
    if not stuck:
        return
    status = _intended_status()
    names = ", ".join(sorted(t.name for t in stuck))
    try:
        sys.stderr.write(
            f"pid {os.getpid()}: library thread(s) {names} still running {EXIT_JOIN_SECONDS:g} s into the exit; "
            f"ending with status {status} without interpreter finalization\n"
        )
    except Exception:  # noqa: BLE001 - stderr may be closed; the exit matters more
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(status)


def _forget_in_child() -> None:
    global _lock, _exit_status, _sys_exit_status
    _lock = threading.Lock()  # the parent's may have been held by another thread at the fork
    _entries.clear()
    _exit_status = _sys_exit_status = None


def _status_of(code: object) -> int:
    """The process status `sys.exit(code)` gives."""
    if code is None:
        return 0
    if isinstance(code, int):
        return int(code) & 0xFF
    return 1  # a message: printed, status 1


_system_exit = sys.exit


def _exit_noting_status(code: object = None) -> NoReturn:
    """`sys.exit`, with its status noted first: an atexit hook cannot read it, and an exit that must
    end past a stuck library thread (`_at_exit`) should still end with the status the script chose.
    Only the main thread's: another thread's `sys.exit` ends that thread, never the process, so a
    `sys.exit(0)` on any thread must not turn a later crash into status 0."""
    global _sys_exit_status
    if threading.current_thread() is threading.main_thread():
        _sys_exit_status = _status_of(code)
    _system_exit(code)


sys.exit = _exit_noting_status
atexit.register(_at_exit)
os.register_at_fork(after_in_child=_forget_in_child)
