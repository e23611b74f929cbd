"""Imports torch would make lazily at a bad moment, made early on a thread.

torch imports torch._dynamo the first time an optimizer is built (about 3 s on
a small CPU), and its agent's log formatter does the same the first time it
logs a worker's traceback: on the critical path of every restart and of the
first recovery, unless it overlaps other work. Workers call this before
loading data and joining the group; the launcher at start.
"""

from __future__ import annotations

import importlib
import logging
import threading

from elastic._shared.common import threads

logger = logging.getLogger(__name__)

SLOW_LAZY_IMPORTS = ("torch._dynamo",)


def prefetch_slow_imports() -> threading.Thread:
    """Import `SLOW_LAZY_IMPORTS` on a library thread (an optimisation only: a failure is
    left for the lazy import to report). The thread holds no resource; join it to wait.
    An import cannot be interrupted: the exit waits for it (`elastic._shared.common.threads`), since
    torch's import code unwound mid-call at finalization aborts the process."""

    def load() -> None:
        for name in SLOW_LAZY_IMPORTS:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - an optimisation only; the lazy import reports errors
                logger.debug("prefetching %s failed", name, exc_info=True)

    return threads.start(load, name="elastic-prefetch-imports")
