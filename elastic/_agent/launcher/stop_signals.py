"""The agent's stop signals raised where torch's agent can take them.

torch's agent turns SIGTERM (and SIGINT, SIGHUP, SIGQUIT) into a `SignalException` raised from the
signal handler, wherever the main thread happens to be; it then stops its workers (SIGTERM to each,
which commit their step) and leaves. One place breaks that: torch's metrics wrapper around the
agent's steps (`torch.distributed.elastic.metrics.api.prof`) assigns its start time inside its
`try`, so an exception raised before that assignment makes its `finally` fail with
UnboundLocalError, which hides the signal: the agent dies without stopping its workers, and their
preemption commit is lost. Seen under Slurm, whose `scancel` signals the agent while it polls its
workers ten times a second.

`raise_safely` is the fix: a stop signal that lands in that spot is sent again a moment later, when
the wrapper has its start time. torch registers its handler each time it starts workers; the agent
(elastic._agent.launcher.revive_agent) calls `guard_torch_handlers` right after each start, which
puts `raise_safely` in front of it, and the agent's requeue signal uses it too
(elastic._agent.launcher.slurm_launch).

Invariant: between torch's registration and the guard no frame of that wrapper can be the one a
signal lands in without its start time: the only such wrapper on the stack then is the worker
start's own, entered (and its start time taken) before torch registered its handler.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

from elastic._agent.timings import RETRY_SECONDS
from elastic._shared.common import threads

TORCH_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
"""The signals torch's worker start registers its handler for when TORCHELASTIC_SIGNALS_TO_HANDLE is unset."""


def _in_unsafe_spot(frame: FrameType | None) -> bool:
    """Whether `frame` is torch's metrics wrapper before it assigned `start`."""
    if frame is None:
        return False
    code = frame.f_code
    return (code.co_name == "wrapper" and code.co_filename.replace(os.sep, "/").endswith(
        "torch/distributed/elastic/metrics/api.py") and "start" not in frame.f_locals)


def _send_again(signum: int) -> None:
    def later() -> None:
        time.sleep(RETRY_SECONDS)
        os.kill(os.getpid(), signum)

    threads.start(later, name="torchrevive-stop-signal-again")


def raise_safely(handler: Callable[[int, FrameType | None], None]) -> Callable[[int, FrameType | None], None]:
    """`handler` (which raises), or, when the signal landed in torch's unsafe spot, the signal again shortly."""

    def safe(signum: int, frame: FrameType | None) -> None:
        if _in_unsafe_spot(frame):
            _send_again(signum)
            return
        handler(signum, frame)

    safe.raises_safely = True  # type: ignore[attr-defined]
    return safe


def guard_torch_handlers() -> None:
    """Put `raise_safely` in front of torch's stop-signal handler on each signal torch registered it for
    (TORCHELASTIC_SIGNALS_TO_HANDLE, torch's default list when unset); a handler that is not torch's (the
    requeue signal's, one already guarded) is left as it is. Only the main thread registers handlers."""
    import torch.distributed.elastic.multiprocessing.api as mp_api

    if threading.current_thread() is not threading.main_thread():
        return
    for name in os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", TORCH_SIGNALS).split(","):
        signum = getattr(signal, name.strip(), None)
        if isinstance(signum, signal.Signals) and signal.getsignal(signum) is mp_api._terminate_process_handler:
            signal.signal(signum, raise_safely(mp_api._terminate_process_handler))
