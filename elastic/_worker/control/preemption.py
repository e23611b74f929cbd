"""Preemption: SIGTERM means "finish this step, commit a checkpoint, exit".

`kubectl delete pod`, a spot-instance reclaim or a batch scheduler send
SIGTERM and wait a grace period before SIGKILL. A worker that dies on the
signal loses every step since its last checkpoint; one that honours it loses
nothing.

Invariants:
- The handler only sets a flag; the loop acts on it at a step boundary, where
  the state is consistent.
- The job learns of a signal through a collective: `requested()` here, or,
  in `elastic.Run`, the step vote (elastic._worker.control.step_vote) that carries
  `signalled`; every rank gets the same answer, so when any one rank is
  signalled (one pod deleted), the whole job checkpoints at the same step.
- A second SIGTERM restores the default action and kills the worker at once,
  for an operator (or agent) who does not want to wait (in a Slurm job, only
  one that comes 2 s after the first: Slurm signals every process of a step,
  and the agent stopping its workers sends them another at once). Inside a Slurm job the
  requeue signal (USR1 by default, elastic._shared.slurm.requeue) stops the job the
  same way and marks it for requeueing; it never kills at once (Slurm may send
  it to a process twice: to the steps, and through the batch shell), and one
  SIGTERM after it (the agent stopping its workers) changes nothing.
- The step boundary where the job agrees to stop (`at_boundary`; in
  `elastic.Run`, the end of the step after the signal's, see step_vote.py)
  must come within `grace` seconds of the signal. A worker
  blocked in a collective whose peer died never gets there (and its Python
  handler does not even run, the main thread being inside C++): a watcher
  thread, woken through `signal.set_wakeup_fd`, then ends the process with
  status 143, so torchrun's agent does not wait its 30 s before SIGKILL when it
  stops the group for a new round.
- Only the process that installed the handler is affected. Children forked
  after it (DataLoader workers, multiprocessing 'fork' children, os.fork) are
  never affected: in them the flag is clear, the SIGTERM disposition and the
  wakeup fd are those from before the install (a child whose Python refuses
  to change them gets its wakeup fd pointed at /dev/null instead), and their
  copies of the socketpair are closed, never shut down. The Slurm requeue
  signal is ignored in them: Slurm sends it to every process of the step. So a SIGTERM that
  reaches only a child ends that child (status -15) and is never read as the
  parent's preemption.
- The watcher is an `elastic._shared.common.threads` one: `uninstall` (or the exit) ends it
  and joins it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from elastic._shared.common import threads
from elastic._shared.slurm.requeue import arrived_early
from elastic._worker.control import agreement
from elastic._worker.runtime.context import WorkerContext
from elastic._worker.timings import DEFAULT_GRACE_SECONDS

logger = logging.getLogger(__name__)

# Handlers installed in this process, oldest first. The fork hook below cannot
# be unregistered, so it acts on whatever is installed at the time of the fork.
_installed: list[PreemptionHandler] = []


def _after_fork_in_child() -> None:
    """Runs in every child forked from this process, before the child's own code.

    Without it the child inherits the Python handler and the wakeup fd: its
    SIGTERM would write into the socket the parent's watcher reads, and end the
    parent as if the parent had been preempted.
    """
    for handler in reversed(_installed):  # newest first: each puts back what the one before it saw
        handler._release_in_child()
    _installed.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class PreemptionHandler:
    """SIGTERM, and inside a Slurm job the requeue signal (elastic._shared.slurm.requeue), mean "stop at the
    next step boundary". The first such signal counts; a second SIGTERM ends the process at once; the
    requeue signal again, or one SIGTERM after it (the agent stopping its workers), changes nothing.

    `duplicate_window`: a SIGTERM within this many seconds of the first is the same one delivered
    twice (in a Slurm job, slurmstepd signals every process of the step and the agent passes its own
    on), not an operator's second."""

    def __init__(
        self, ctx: WorkerContext, signum: int = signal.SIGTERM, grace: float = DEFAULT_GRACE_SECONDS,
        *, requeue_signum: int | None = None, duplicate_window: float = 0.0,
    ) -> None:
        self._ctx = ctx
        self._signum = signum
        self._requeue_signum = requeue_signum
        self._signals = tuple(s for s in (signum, requeue_signum) if s is not None)
        self._grace = grace
        self._flag = False
        self._received: int | None = None
        self._announced = False
        self._holds = 0  # `hold` blocks entered and not left (they nest)
        self._duplicate_window = duplicate_window
        self._first_term: float | None = None  # when the first SIGTERM came: a later one ends the process
        self._previous: dict[int, object] = {}
        self._reached_boundary = threading.Event()
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._watcher: threading.Thread | None = None
        self._previous_wakeup_fd = -1
        if threading.current_thread() is threading.main_thread():
            for each in self._signals:
                self._previous[each] = signal.signal(each, self._on_signal)
            self._watch_for_blocked_signal()
            _installed.append(self)
            if requeue_signum is not None and arrived_early():  # before this handler took over
                self._on_signal(requeue_signum, None)

    def _watch_for_blocked_signal(self) -> None:
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._previous_wakeup_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._wakeup = (reader, writer)
        self._watcher = threads.start(self._watch, args=(reader,), name="elastic-sigterm-grace", stop=self._stop_watcher)

    def _stop_watcher(self) -> None:
        """At exit: uninstall from the main thread; elsewhere only wake the watcher, which then returns."""
        if threading.current_thread() is threading.main_thread():
            self.uninstall()
        elif self._wakeup is not None:
            self._wakeup[0].shutdown(socket.SHUT_RDWR)

    def _release_in_child(self) -> None:
        """In a forked child: drop everything shared with the parent, leave the parent's untouched.

        Invariants: the child is not signalled; its SIGTERM disposition and
        wakeup fd are the ones from before the install; its copies of the
        socketpair are closed with close() only, never shutdown(), which would
        act on the socket itself and stop the parent's watcher.
        """
        self._flag = False  # the parent's signal is not the child's
        self._watcher = None  # not forked with the child
        self._reached_boundary = threading.Event()  # the parent's may have been mid-use by another thread
        self._received = None
        self._announced = False
        self._holds = 0
        self._first_term = None
        wakeup, self._wakeup = self._wakeup, None
        previous, self._previous = self._previous, {}
        wakeup_cleared = True
        if wakeup is not None:
            try:
                signal.set_wakeup_fd(self._previous_wakeup_fd)
            except ValueError:  # Python does not see this thread as the main one (a fork from another thread)
                wakeup_cleared = False
        for each, disposition in previous.items():
            if each == self._requeue_signum:
                disposition = signal.SIG_IGN  # Slurm signals the child too: the parent acts for it
            try:
                signal.signal(each, disposition)
            except ValueError:  # same cause; then Python never runs the handler in this child anyway
                logger.debug("forked child could not restore the %s disposition", signal.Signals(each).name)
        if wakeup is None:
            return
        reader, writer = wakeup
        reader.close()
        if wakeup_cleared:
            writer.close()
            return
        # The writer is still this child's wakeup fd: point that fd number at
        # /dev/null and keep it taken, so the child's signal bytes go nowhere
        # and a file opened later cannot reuse the number.
        devnull = os.open(os.devnull, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            os.dup2(devnull, writer.fileno(), inheritable=False)
        finally:
            os.close(devnull)
        writer.detach()

    def _watch(self, reader: socket.socket) -> None:
        """Runs beside the main thread: sees the signal even while the main thread is stuck.

        After the first signal it keeps reading while it waits for the step
        boundary, so a second signal ends the process at once even when the main
        thread is blocked in C++ (where the Python handler cannot run).
        """
        seen: dict[int, int] = {}
        first_term: float | None = None
        deadline: float | None = None
        while True:
            timeout = None
            if deadline is not None and not self._reached_boundary.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    first = self._received or self._signum
                    print(
                        f"preemption: {signal.Signals(first).name} arrived but no step ended within "
                        f"{self._grace:g} s (blocked in a collective?); exiting without a checkpoint",
                        file=sys.stderr, flush=True,
                    )
                    os._exit(128 + first)
                timeout = min(remaining, 0.05)  # look at the boundary between reads
            try:
                reader.settimeout(timeout)
                data = reader.recv(64)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:  # uninstalled
                return
            for each in self._signals:
                seen[each] = seen.get(each, 0) + data.count(each)
            if self._signum in data:
                if first_term is None:
                    first_term = time.monotonic()
                elif time.monotonic() - first_term >= self._duplicate_window:
                    os._exit(128 + self._signum)  # SIGTERM again: no more waiting
            if deadline is None and any(seen.values()):
                deadline = time.monotonic() + self._grace

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == self._signum:
            now = time.monotonic()
            if self._first_term is None:
                self._first_term = now
            elif now - self._first_term >= self._duplicate_window:  # SIGTERM again: the default action, now
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)
                return
        if self._flag:
            return  # the requeue signal again (Slurm may deliver it more than once), or SIGTERM after it
        self._flag = True
        self._received = signum
        if signum == self._requeue_signum:  # only Slurm sends it: said now; a SIGTERM when the job acts on it
            self._announce()

    def _announce(self) -> None:
        """Say once that this process's signal stops the job. A SIGTERM is said when the job acts on it, not in
        the handler: under `--survivors restart` torchrun stops the survivors of a peer's death with SIGTERM
        too, and those leave with the peer's death as their one line (elastic._worker.run.peer_loss)."""
        if self._received is None or self._announced:
            return
        self._announced = True
        then = ", then requeueing the Slurm job" if self._received == self._requeue_signum else ""
        logger.warning("received %s: finishing this step, then checkpointing and exiting%s",
                       signal.Signals(self._received).name, then)

    @property
    def signalled(self) -> bool:
        """Whether this process received the signal (no communication)."""
        return self._flag

    @property
    def requeue_signalled(self) -> bool:
        """Whether the signal this process received first was the Slurm requeue signal."""
        return self._flag and self._received == self._requeue_signum

    def requested(self) -> bool:
        """Whether any rank was signalled (a collective: call it on every rank at every step)."""
        return self.vote()[0]

    def vote(self, *flags: bool) -> tuple[bool, ...]:
        """`requested()`, and for each of this rank's `flags` whether any rank raised it:
        one collective for the step's every stop reason."""
        answer = agreement.any_set(self._ctx, self._flag, *flags)
        if answer[0]:
            self._reached_boundary.set()  # the checkpoint that follows may take its time
            self._announce()
        return answer

    def at_boundary(self) -> None:
        """The job agreed to stop at this step (the step vote): the checkpoint that follows may take its time."""
        self._reached_boundary.set()
        self._announce()

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Work between steps (evaluation, the final save): a SIGTERM arriving now waits for
        the caller's vote after it instead of ending the process after the grace."""
        self._holds += 1
        self._reached_boundary.set()
        try:
            yield
        finally:
            self._holds -= 1
            if not self._flag and not self._holds:  # nested (a pause inside an epoch's end): the outer one holds on
                self._reached_boundary.clear()

    def uninstall(self) -> None:
        if self in _installed:
            _installed.remove(self)
        for each, disposition in self._previous.items():
            if each == self._requeue_signum and disposition in (signal.SIG_DFL, None):
                disposition = signal.SIG_IGN  # a late repeat of Slurm's signal must not kill a finished run
            signal.signal(each, disposition)
        self._previous = {}
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            reader, writer = self._wakeup
            reader.shutdown(socket.SHUT_RDWR)  # wakes the watcher's recv with b""
            watcher, self._watcher = self._watcher, None
            if watcher is not None and watcher is not threading.current_thread():
                watcher.join(timeout=5)  # it returns at once; the bound is for a watcher mid-exit
            reader.close()
            writer.close()
            self._wakeup = None

