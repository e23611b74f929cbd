"""The store a survivors' group forms on, watched: a member waiting for a peer that will never come
gives up as soon as the group is given up, not after the group's timeout.

A process group forms inside torch: in `init_process_group`, and again in each `new_group` built on
the default group's store afterwards (the checkpoint saver's group, the control group), every member
publishes its address on the store and waits there for every other member's. A member that dies
before it published leaves the others waiting inside torch, where nothing of the runtime reaches
them, for the whole timeout; with `keep` its replacement meanwhile waits for them in the next
generation (the soak of issue 52 saw two live ranks wait 11 minutes so).

So while a read of such a group's store waits, a watcher thread asks `given_up()` every slice: with
`keep`, whether the round's heal count moved past the group's generation (an agent replaced a member
that had arrived at it: regroup.superseded); with `train-on`, whether a member of the view was marked
failed by its agent. Once it is, the watcher writes the awaited keys (the wait returns at once) and
the read raises `GroupGivenUp`, a RuntimeError torch passes on to the caller, which forms the next
generation's (or view's) group.

Invariants:
- A read returns exactly what the inner store's would, as soon as it would: the inner store's own
  blocking wait does the waiting (no polling latency, no timeouts logged by torch's store client).
- `given_up` is asked only while a read waits, at most every `MAX_SLICE` seconds: a group whose
  members all came never pays for it, and a given-up group is left within about that long.
- The store's own timeout still bounds every wait (torch's `DistStoreError`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta

from torch.distributed import Store

from elastic._shared.timings import EXIT_JOIN_SECONDS
from elastic._worker.timings import FORMING_FIRST_SLICE
from elastic._worker.timings import FORMING_MAX_SLICE as MAX_SLICE

logger = logging.getLogger(__name__)

_ALIVE: list[Store] = []  # (the pybind trampoline of a Python store must outlive torch's use of it)
_KEEP_ALIVE = 64


GIVEN_UP = "the group forming was given up"
"""How a `GroupGivenUp` message begins: torch may hand it on as another RuntimeError, with its text."""


class GroupGivenUp(RuntimeError):
    """The group being formed was given up (a member died while it formed): form the next one."""


def given_up(error: BaseException) -> bool:
    """Whether `error` (raised out of torch) is a watched store's `GroupGivenUp`, whatever torch made of its type."""
    return isinstance(error, GroupGivenUp) or GIVEN_UP in str(error)


class FormingStore(Store):
    """`inner` with its blocking reads watched by `given_up` (see the module docstring): `given_up(store)`
    reads `store` (a second connection to `inner`'s, the first being blocked in the wait) and returns why
    the group was given up, or None while it stands."""

    def __init__(self, inner: Store, given_up: Callable[[Store], str | None]) -> None:
        super().__init__()  # the pybind trampoline needs it
        self.inner = inner
        self._given_up = given_up
        self.set_timeout(inner.timeout)
        _ALIVE.append(self)
        del _ALIVE[:-_KEEP_ALIVE]  # one per group formed: the last few are enough

    def clone(self) -> FormingStore:
        twin = FormingStore(self.inner.clone(), self._given_up)
        twin.set_timeout(self.timeout)
        return twin

    def has_extended_api(self) -> bool:
        return self.inner.has_extended_api()

    # --- writes and non-blocking reads: the inner store's ---------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        self.inner.set(key, value)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self.inner.multi_set(keys, values)

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        return self.inner.compare_set(key, expected_value, desired_value)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def append(self, key: str, value: str | bytes) -> None:
        self.inner.append(key, value)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    # Through `dist.PrefixStore` torch's bridge calls these two by their C++ names.
    deleteKey = delete_key  # noqa: N815
    getNumKeys = num_keys  # noqa: N815

    # --- blocking reads: watched ---------------------------------------------------------

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self.inner.get(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(keys)
        return self.inner.multi_get(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if self.inner.check(keys):  # a healthy group's usual case: no watcher at all
            return
        watcher = _Watcher(self.inner, keys, self._given_up)
        try:
            self.inner.wait(keys, self.timeout if timeout is None else timeout)
        finally:
            why = watcher.stop()
        if why is not None:
            raise GroupGivenUp(f"{GIVEN_UP}: {why}")


class _Watcher:
    """While a read waits on `keys`: asks `given_up()` every slice; once the group is given up, it
    writes `keys` through a second connection (the waiting one is blocked), which ends the wait at
    once (the waiter then raises; the group's namespace is never used again: generations and view
    numbers only grow)."""

    def __init__(self, store: Store, keys: list[str], given_up: Callable[[Store], str | None]) -> None:
        self._store, self._keys, self._given_up = store, list(keys), given_up
        self._done = threading.Event()
        self.why: str | None = None
        self._thread = threading.Thread(target=self._watch, name="torchrevive-forming-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        piece, twin = FORMING_FIRST_SLICE, None
        while not self._done.wait(piece):
            piece = min(piece * 2, MAX_SLICE)
            try:
                twin = twin or self._store.clone()  # (a client's calls queue behind its blocked wait)
                why = self._given_up(twin)
                if why is None:
                    continue
                self.why = why
                for key in self._keys:
                    if not twin.check([key]):
                        twin.set(key, b"given up")
            except RuntimeError as error:  # the store failed: the wait itself finds out
                logger.debug("could not ask whether the group was given up: %s", error)
                continue
            return

    def stop(self) -> str | None:
        """End the watch (the wait returned or failed); why the group was given up, if it was."""
        self._done.set()
        self._thread.join(EXIT_JOIN_SECONDS)
        return self.why
