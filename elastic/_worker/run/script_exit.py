"""The end of a script that joined with `Run.open()` instead of a `with` block.

A script written at module level (nanoGPT's `train.py` is the best-known
kind) has no natural place for `with`. `Run.open()` registers a `ScriptExit`:
at the interpreter's exit it leaves the run exactly as the end of a `with`
block would, with the exception that ended the script, if any (the
`excepthook` it installs records it before the exit handlers run).

Invariants:
- The run is left once: by `Run.close()` (which unregisters the exit hook) or
  here, never both.
- The exit status and the one line are `elastic.run_main`'s, so a script reads
  the same whether it has a `main()` or not.
- An error of the library (`ElasticError`: `Preempted`, a storage stop, a usage
  error, raised in the script or by the final save) ends the process with one
  stderr line and its exit status (143, 75, 2, ...), as `elastic.run_main` makes
  of it in a script with a `main()`, never with a traceback. Only that case ends
  with `os._exit` (an exit hook cannot set the status otherwise), after the
  library's threads were stopped and stdout, stderr and logging flushed; any
  other exception keeps Python's own traceback and status 1.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Callable
from types import TracebackType

from elastic._shared.common import threads
from elastic._shared.common.errors import ElasticError

Leave = Callable[[type[BaseException] | None, BaseException | None, TracebackType | None], None]
ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], object]


class ScriptExit:
    """Leaves a run at the interpreter's exit (see the module docstring)."""

    def __init__(self, leave: Leave) -> None:
        self._leave = leave
        self.pending = True
        """The run has not been left yet."""
        self._uncaught: tuple[type[BaseException], BaseException, TracebackType | None] | None = None

    @classmethod
    def install(cls, leave: Leave) -> ScriptExit:
        """Leave with `leave` at the interpreter's exit, told of the exception that ended the script."""
        script_exit = cls(leave)
        atexit.register(script_exit.at_exit)
        sys.excepthook = script_exit.excepthook(sys.excepthook)
        return script_exit

    def uninstall(self) -> None:
        """The run was left by the script itself (`Run.close`)."""
        self.pending = False
        atexit.unregister(self.at_exit)

    def excepthook(self, previous: ExceptHook) -> ExceptHook:
        """`sys.excepthook` for the script: remembers the exception that ended it; a library error is one line."""

        def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> object:
            if not self.pending:  # the run was left (`Run.close`): python's own report, as without a run
                return previous(exc_type, exc, tb)
            self._uncaught = (exc_type, exc, tb)
            if isinstance(exc, ElasticError):
                return None  # said in one line once the run has been left (`at_exit`)
            return previous(exc_type, exc, tb)

        return hook

    def at_exit(self) -> None:
        if not self.pending:
            return
        self.pending = False
        exc_type, exc, tb = self._uncaught if self._uncaught is not None else (None, None, None)
        error = exc if isinstance(exc, ElasticError) else None
        try:
            self._leave(exc_type, exc, tb)
        except ElasticError as raised:  # the final save failed, or the replicas diverged
            error = raised
        if error is None:
            return
        prog = os.path.basename(sys.argv[0]) or "python"
        sys.stderr.write(f"{prog}: error: {error}\n")
        threads.stop_all(threads.EXIT_JOIN_SECONDS)
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(error.exit_code)
