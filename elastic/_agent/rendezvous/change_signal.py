"""A run's membership changes, announced through the rendezvous store, and the waits that wake on them.

Every membership write of a quick-rounds handler (quick_rounds.py) bumps a
counter in the store and sets the key for the counter's new value; a waiter
wakes when that key is set (etcd: a watch, which costs etcd nothing while it
waits), or, on a TCPStore, on the news of a watcher thread of this process that
blocks in the store on a connection of its own. Between rounds an agent's looks
(`ChangeSignal.latest`) read what the watcher saw: no store operation while
nothing changes. The counter lives in a `SealedStore`: a stranger's value reads
as absent and is replaced, so at worst a waiter sleeps torch's 1 s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from elastic._agent.timings import (
    POLL_FIRST_SECONDS,
    POLL_MAX_SECONDS,
    RESYNC_SECONDS,
    STRAY_PAUSE_SECONDS,
    WAKE_TIMEOUT,
    WATCH_FOR,
)
from elastic._shared.common import threads

KEPT_CHANGE_KEYS = 64
"""Change keys older than this many changes are deleted (a waiter that far behind wakes by timeout)."""


class ChangeSignal:
    """Membership changes of one run, announced through a store: a counter and, with `watch`,
    a key per value.

    Invariants: a waiter that read `generation()` before it read the state, and then waits
    with `wait_after`, wakes on any change announced after that read (the counter moved;
    with `watch`, the key for the next value was set by the write that made the change),
    or at its timeout. A store that fails raises `RendezvousConnectionError`, as torch's
    backends do, so torch's handler treats it as it treats its own (at the end of a job,
    when the agent that served the store has left, one warning line, no traceback)."""

    def __init__(self, store: Any, run_id: str, *, watch: bool) -> None:
        self._store = store
        self._counter = f"torchrevive.rdzv.{run_id}.changes"
        self._watch = watch
        self._use(lambda: store.add(self._counter, 0))  # created once: reading it is then a plain read
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        """Notified whenever `_latest` moves (the watcher, `announce`): what waiters wait on."""
        self._latest = -1
        """The newest generation seen (the watcher's, or a look's own read); -1 before any."""
        self._resync_at = float("-inf")
        self._watcher: threading.Thread | None = None
        self._stopping = threading.Event()
        self._waking: tuple[Any, str] | None = None
        """The watcher's own connection for waking it at exit, and the key it waits on now."""

    def generation(self) -> int:
        """The counter, never below a change this process saw: a stranger's value reads the counter back
        from zero, and a waiter whose generation went back behind the changes it saw would wake at once,
        again and again (two agents read the state in a busy loop)."""
        value = int(self._use(lambda: self._store.add(self._counter, 0)))
        with self._lock:
            return max(value, self._latest)

    def _peek(self, store: Any) -> int | None:
        """The counter in `store`, read without writing it (a look, the watcher: neither may bring back the
        key after the run's last agent removed the run's keys); None when it cannot be read."""
        read_count = getattr(store, "read_count", None)
        if read_count is None:
            return int(store.add(self._counter, 0))
        return read_count(self._counter)

    def latest(self) -> int:
        """The newest generation announced, as the watcher last saw it: no store operation while nothing
        changes. The first call starts the watcher; the counter itself is read at the first call, again
        whenever the watcher has stopped (its store failed), and at least every `RESYNC_SECONDS`."""
        now = time.monotonic()
        with self._lock:
            watching = self._watcher is not None and self._watcher.is_alive()
            if watching and now < self._resync_at:
                return self._latest
            self._resync_at = now + RESYNC_SECONDS
        current = self._use(lambda: self._peek(self._store))
        with self._lock:
            if current is None:  # (missing or not verified: what the watcher last saw stands)
                current = max(self._latest, 0)
            self._latest = max(self._latest, current)
            if self._watcher is None and self._watch:  # (etcd: its wait is Python's, safe at finalization)
                self._watcher = threading.Thread(target=self._watch_changes, args=(current,),
                                                 name="torchrevive-rdzv-changes", daemon=True)
                self._watcher.start()
            elif self._watcher is None:  # (a TCPStore: its wait is C++'s, see `_stop_watching`)
                self._watcher = threads.start(self._watch_changes, args=(current,), name="torchrevive-rdzv-changes",
                                              stop=self._stop_watching)
            return self._latest

    def _watch_changes(self, seen: int) -> None:
        """The watcher: block on the key of the change after `seen` (set by `announce`, after the counter),
        then read the counter; until the store fails (the job ends) or the process exits (`_stop_watching`)."""
        try:
            store = self._store.clone()  # a connection of its own: a blocked wait holds its connection
            inner = getattr(store, "inner", store)  # its raw wait: any value wakes it, the counter decides
            waker = inner.clone()  # (made now: at exit a connect to a stalled server could hang)
            waker.set_timeout(WAKE_TIMEOUT)
            while not self._stopping.is_set():
                key = f"{self._counter}.{seen + 1}"
                with self._lock:
                    self._waking = (waker, key)
                inner.wait([key], WATCH_FOR)
                current = self._peek(store)
                if current is not None and current > seen:
                    seen = current
                    with self._changed:
                        self._latest = max(self._latest, current)
                        self._changed.notify_all()
                else:
                    self._stopping.wait(STRAY_PAUSE_SECONDS)
        except Exception:  # noqa: BLE001 - a store that failed or went away: looks read the counter again
            return

    def _stop_watching(self) -> None:
        """At exit (elastic._shared.common.threads): wake the watcher by setting the key it waits on, so that
        it ends before finalization. Left blocked, its wait could return while the interpreter finalizes (the
        server's agent exiting at the same time), and take the GIL back in a C++ frame: "terminate called
        without an active exception", SIGABRT, for an agent whose job had succeeded (test_slurm's
        replacement, once in a full suite). Other agents' watchers wake on that key too and find the counter
        unmoved: they read it once a `STRAY_PAUSE_SECONDS` until the next change, as after a stranger's key."""
        self._stopping.set()
        with self._lock:
            waking = self._waking
        if waking is not None:
            waker, key = waking
            try:
                waker.set(key, b"")
            except Exception:  # noqa: BLE001 - a server gone: the wait has failed, or does so now
                pass

    def announce(self) -> None:
        value = int(self._use(lambda: self._store.add(self._counter, 1)))
        with self._lock:
            behind = self._latest + 1 - value
        if behind > 0:  # read back from zero (a stranger's value): past every change seen, so watchers wake
            value = int(self._use(lambda: self._store.add(self._counter, behind)))
        self._use(lambda: self._store.set(f"{self._counter}.{value}", b"1"))
        with self._changed:
            self._latest = max(self._latest, value)
            self._changed.notify_all()
        if value > KEPT_CHANGE_KEYS:
            try:
                self._store.delete_key(f"{self._counter}.{value - KEPT_CHANGE_KEYS}")
            except Exception:  # noqa: BLE001 - best effort: a key left behind is harmless, a failed round is not
                pass

    @staticmethod
    def _use(operation: Callable[[], Any]) -> Any:
        try:
            return operation()
        except RendezvousConnectionError:
            raise
        except (RuntimeError, ValueError, TimeoutError) as exc:  # DistNetworkError, DistStoreError, etcd's
            raise RendezvousConnectionError(f"the rendezvous store failed: {exc}".splitlines()[0]) from exc

    def wait_after(self, generation: int, timeout: float) -> None:
        """Return when a change after `generation` is announced, or after `timeout` seconds. On a store
        that is not watched (TCPStore) the watcher's news, no store operation while it waits (a read of
        the counter every 5 to 50 ms before: most of a round's operations at 64 nodes); the counter
        polled only when the watcher has stopped."""
        if not self._watch:
            self.latest()  # (starts the watcher; reads the counter itself at most every RESYNC_SECONDS)
            with self._changed:
                if self._watcher is not None and self._watcher.is_alive():
                    self._changed.wait_for(lambda: self._latest > generation, timeout)
                    return
            self._poll_after(generation, time.monotonic() + timeout)
            return
        try:
            self._store.wait([f"{self._counter}.{generation + 1}"], timedelta(seconds=timeout))
        except (RuntimeError, TimeoutError):
            pass  # timed out (a store that failed says so at the next read of the state)

    def _poll_after(self, generation: int, deadline: float) -> None:
        pause = POLL_FIRST_SECONDS
        while self.generation() == generation:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(pause, left))
            pause = min(pause * 2, POLL_MAX_SECONDS)
