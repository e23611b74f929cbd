"""Which workers train together when the survivors train on (TORCHREVIVE_SURVIVORS=train-on).

A *view* is one process group of a round: a number and its members
(`heal_env.member_id`: the rank a worker started with and its incarnation),
sorted by that rank, so a node's workers stay next to each other. A worker's
rank in a view is its place in the list. View 0 is the round's start: ranks
0..W-1, incarnation 0. Each later view is written once to the rendezvous store
(the round's heal namespace) by a compare-and-set, so every worker reads the
same list, whoever wrote it.

A view follows another in one of two ways:
- shrink (`after_failure`): a collective failed; every member that can still
  act arrives at the next view, which closes as soon as every member of the
  last one arrived or was marked failed by its agent, else `settle` seconds
  after its closer arrived (a lost node's workers are never marked: their
  agent is gone too). A member that arrives after the close is not in it: it
  waits to join, as a replacement does. The closer is the first member to
  claim it (a compare-and-set): it alone reads the arrivals, each member's
  once it is there (the missing ones at every poll); the others poll the
  view's one key. A closer that died too is replaced by the first waiter to
  claim the next closer slot `settle` seconds later.
- grow (`joiners.admit`): rank 0 of the current view closes the next one as
  the current members plus the workers waiting to join whose tickets it saw
  (elastic._worker.survivors.joiners: the joiners' side is there).

Every record here goes through `store_records.Records`: sealed with the job's
secret (when the worker has one), and read back checked; one that is forged or
invalid is ignored with one warning (a stranger who can reach the store can
neither join a view, nor mark a member failed, nor end the job).

Invariants:
- A view number is closed once (compare-and-set) and views are numbered 1, 2,
  ... in the order they close; `LATEST_KEY` only grows.
- A list read back from the store is checked (`parse`): ids that parse, each
  start rank at most once and below the round's world size, a count of tickets
  that is a count; else `ViewError` (`read_view`: ignored with one warning).
- No loop runs once per unit of a number read from the store: arrivals and
  presence are one key per member of the view (at most the round's world size).
- A member's share of a shrink or a forming is O(1) store operations: one
  aggregator (the closer; the view's first member for its forming) reads the
  members' keys, each once it is there; the others poll one key (forming, and failure marks every
  `MARK_CHECK_SECONDS`).
- A view forms (`gather`) only once all its members are there, within a bound,
  and its members agree whether it formed (a compare-and-set of the outcome):
  a member that died after the view closed makes it given up, and the others
  shrink from it.
- Nothing here waits without bound.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from elastic._shared.common.errors import ElasticError
from elastic._shared.protocol import heal_env
from elastic._shared.storage.store_records import Records, strict_count
from elastic._worker.survivors.forming_store import FormingStore
from elastic._worker.timings import (
    GATHER_SECONDS,
    MARK_CHECK_SECONDS,
    SETTLE_SECONDS,
    VIEW_MAX_POLL_S as _MAX_POLL_S,
    VIEW_POLL_S as _POLL_S,
)

LATEST_KEY = "view/latest"
_MAX_MEMBERS = 1 << 16
_MAX_VIEWS = 1 << 30


class ViewError(ElasticError):
    """A view's record in the store is malformed (one line): the worker exits with the status of a heal
    that did not form, and its agent takes a new round."""

    exit_code = heal_env.HEAL_FAILED_EXIT


@dataclass(frozen=True)
class View:
    """One group of the round: who is in it, in rank order."""

    number: int
    members: tuple[str, ...]
    considered: int = 0
    """Tickets of joiners (`joiners.register_joiner`) up to this one were considered for it or before it."""
    grown: bool = False
    """Closed by a grow (`admit`, at a step's bookkeeping), not after a failure (`after_failure`)."""

    @property
    def world_size(self) -> int:
        return len(self.members)

    def rank_of(self, member: str) -> int | None:
        return self.members.index(member) if member in self.members else None

    def encode(self) -> str:
        return f"{self.considered}|{'grow' if self.grown else 'shrink'}|{','.join(self.members)}"

    @classmethod
    def parse(cls, number: int, text: str, world: int = _MAX_MEMBERS) -> View:
        considered, bar, rest = text.partition("|")
        kind, bar2, listed = rest.partition("|")
        if not (bar and bar2 and kind in ("grow", "shrink") and considered.isascii() and considered.isdigit()
                and len(considered) <= 18):
            raise ViewError(f"view {number} in the store is malformed: {text[:80]!r}")
        try:
            members = tuple(listed.split(",")) if listed else ()
            ranks = [heal_env.parse_member_id(member)[0] for member in members]
        except ValueError as error:
            raise ViewError(f"view {number} in the store is malformed: {error}") from None
        if not 0 < len(members) <= min(world, _MAX_MEMBERS) or len(set(ranks)) != len(ranks) or ranks != sorted(ranks):
            raise ViewError(f"view {number} in the store lists {len(members)} workers, not each rank once in order")
        if ranks[-1] >= world:
            raise ViewError(f"view {number} in the store names rank {ranks[-1]} of a round of {world}")
        return cls(number, members, int(considered), kind == "grow")


def first_view(world_size: int) -> View:
    """The round's start: every rank, incarnation 0."""
    return View(0, tuple(heal_env.member_id(rank, 0) for rank in range(world_size)))


def _members_key(number: int) -> str:
    return f"view/{number}/members"


def _arrival_key(number: int, member: str) -> str:
    return f"view/{number}/arrived/{member}"


def _present_key(number: int, member: str) -> str:
    return f"view/{number}/present/{member}"


def view_group_store(store: dist.Store, view: View, records: Records | None = None) -> dist.Store:
    """Where the process group of `view` meets; with `records` (the round's), watched: a wait there gives
    up once a member of the view was marked failed by its agent (forming_store)."""
    if records is not None:
        store = FormingStore(store, lambda twin: _marked_failed(records.on(twin), view))
    return dist.PrefixStore(f"view/{view.number}/group", store)


def _marked_failed(records: Records, view: View) -> str | None:
    """Why the group of `view` is given up (None: it is not): one of its members was marked failed."""
    for member in view.members:
        if failed(records, member):
            return f"worker {member} of view {view.number} failed while its group formed"
    return None


def _parse(records: Records, number: int, text: str | None) -> View | None:
    """A view record's value as a view; None (one warning) when it is not one."""
    if text is None:
        return None
    try:
        return View.parse(number, text, records.world)
    except ViewError as error:
        return records.warn_once(_members_key(number), f"is not a view ({error})")


def read_view(records: Records, number: int) -> View | None:
    """View `number` if it closed, else None (does not wait); a forged or invalid record is not one."""
    return _parse(records, number, records.get(_members_key(number)))


def latest(records: Records) -> int:
    """The newest view closed in the round (0: none after the start, or a record that is not the job's)."""
    text = records.get(LATEST_KEY)
    newest = strict_count(text, most=_MAX_VIEWS) if text is not None else 0
    return newest if newest is not None else records.warn_once(LATEST_KEY, "is not a count") or 0


def close_view(records: Records, number: int, members: list[str], considered: int, *, grown: bool = False) -> View:
    """Close view `number` with `members` unless another worker closed it first; the view as closed
    (a shrink's closer, or a grow's rank 0: `joiners.admit`). `LATEST_KEY` only grows."""
    ordered = sorted(set(members), key=lambda member: heal_env.parse_member_id(member))
    proposal = View(number, tuple(ordered), considered, grown).encode()
    closed = _parse(records, number, records.compare_set(_members_key(number), proposal))
    if closed is None:  # another process took the slot: no view of this job can close under it
        raise ViewError(f"view {number}'s record in the rendezvous store is not this job's")
    for _ in range(4 * records.world + 4):  # LATEST_KEY only grows (a compare-and-set loop, one try per closer)
        raw = records.raw(LATEST_KEY)
        if latest(records) >= number and raw:
            break
        records.swap(LATEST_KEY, raw, str(number))
    return closed


def _closer_key(number: int, level: int) -> str:
    return f"view/{number}/closer/{level}"


def backoff(attempt: int) -> float:
    """How long a wait's poll number `attempt` sleeps: from `_POLL_S`, doubling up to `_MAX_POLL_S`."""
    return min(_POLL_S * 2 ** min(attempt, 16), _MAX_POLL_S)


def arrive(records: Records, last: View, me: str) -> None:
    """`me` survived `last`, which broke: count it in for the view after `last` (first thing, before any
    slow teardown, so that survivors arrive close together)."""
    records.set(_arrival_key(last.number + 1, me), "1")


def failed(records: Records, member: str) -> bool:
    """Whether `member`'s agent marked it failed (it replaces it: the worker, if alive, must leave)."""
    return records.get(heal_env.failed_key(member)) == "1"


def after_failure(
    records: Records, last: View, me: str, *, settle: float = SETTLE_SECONDS, arrived_already: bool = False,
    leaving: Callable[[], bool] = lambda: False,
    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
) -> View | None:
    """The view after `last`, which broke: arrive at it (unless `arrive` did) and return it once closed
    (see the module docstring). It holds the members that arrived and were not marked failed, so it may
    not hold `me` (`me` came too late). None when `leaving()` turned true while it waited (this worker is
    being stopped: the caller marks it failed, and the view closes without it)."""
    number = last.number + 1
    if not arrived_already:
        arrive(records, last, me)
    deadline = clock() + settle
    for level in itertools.count():  # another member closes it; if it never does, the next level's claimer
        if (closed := read_view(records, number)) is not None:
            return closed
        if records.compare_set(_closer_key(number, level), me) == me:
            return _close_after_failure(records, last, deadline, leaving, clock, sleep)
        attempt, deadline = 0, deadline + settle
        while (closed := read_view(records, number)) is None and clock() < deadline:
            if leaving():
                return None
            sleep(backoff(attempt))
            attempt += 1
        if closed is not None:
            return closed
    raise AssertionError("unreachable")


def _close_after_failure(records: Records, last: View, deadline: float, leaving: Callable[[], bool],
                         clock: Callable[[], float], sleep: Callable[[float], None]) -> View | None:
    """The closer: each arrival read once it is there, the missing ones' and their failure marks each poll."""
    number, arrived, attempt = last.number + 1, set[str](), 0
    while True:
        missing = [m for m in last.members if m not in arrived]
        arrived.update(m for m in missing if records.get(_arrival_key(number, m)) == "1")
        waiting = [m for m in missing if m not in arrived and not failed(records, m)]
        if not waiting or clock() >= deadline:
            alive = [m for m in last.members if m in arrived and not failed(records, m)]  # not being stopped
            if not alive:  # every one that came is being replaced: nobody closes an empty view
                raise ViewError(f"every worker that came to view {number} was marked failed")
            return close_view(records, number, alive, last.considered)
        if leaving():
            return None  # (a waiter takes over at the next closer level)
        if (closed := read_view(records, number)) is not None:  # a waiter took over from a closer it thought dead
            return closed
        sleep(backoff(attempt))
        attempt += 1


def gather(records: Records, view: View, me: str, *, timeout: float = GATHER_SECONDS,
           clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> bool:
    """Note `me` present in `view` and wait for the others: True when the view forms, False when
    it was given up. One outcome for all (a compare-and-set): "formed" by the view's first member once
    it saw every one present (it alone reads the presence keys, each once it is there), or "given up" by
    the first whose `timeout` passed before; a member that gave up after the first saw everyone still
    forms it (it had noted itself present). A member that is missing and marked failed by its agent (a
    joiner killed between its admission and its arrival) never comes: the view is given up at once, not
    after `timeout` (every `MARK_CHECK_SECONDS`, the first member reads the missing ones' marks, the others
    the first member's: between those, their polls stay one read of the outcome).
    Presence is one key per member (a count would be anyone's to raise); an outcome that is not the job's
    is not one."""
    outcome = f"view/{view.number}/outcome"
    deadline, attempt = clock() + timeout, 0
    records.set(_present_key(view.number, me), "1")
    first = view.members[0]
    missing = [m for m in view.members if m != me] if me == first else None
    mark_checked = clock() - MARK_CHECK_SECONDS
    while True:
        if missing is not None:
            missing = [m for m in missing if records.get(_present_key(view.number, m)) != "1"]
            if not missing:
                return records.compare_set(outcome, "formed") == "formed"
        if (said := records.get(outcome)) in ("formed", "given up"):
            return said == "formed"
        dead = False
        if clock() - mark_checked >= MARK_CHECK_SECONDS:
            mark_checked = clock()
            dead = any(failed(records, m) for m in (missing if missing is not None else [first]))
        if dead or clock() >= deadline:
            return records.compare_set(outcome, "given up") == "formed"
        sleep(backoff(attempt))
        attempt += 1
