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
  after this member arrived (a lost node's workers are never marked: their
  agent is gone too). A member that arrives after the close is not in it: it
  waits to join, as a replacement does.
- grow (`admit`): rank 0 of the current view closes the next one as the
  current members plus the workers waiting to join (`register_joiner`) whose
  tickets it saw; which tickets a view considered travels with it, so a joiner
  passed over by a shrink that closed first is admitted by a later grow.

Invariants:
- A view number is closed once (compare-and-set) and views are numbered 1, 2,
  ... in the order they close; `LATEST_KEY` only grows.
- A list read back from the store is checked (`parse`): ids that parse, each
  start rank at most once, a count of tickets that is a count; else `ViewError`.
- A view forms (`gather`) only once all its members are there, within a bound,
  and its members agree whether it formed (a compare-and-set of the outcome):
  a member that died after the view closed makes it given up, and the others
  shrink from it.
- Nothing here waits without bound but `wait_for_admission`, which also ends
  when the job ended (`heal_env.ENDED_KEY`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from elastic._shared.common.errors import ElasticError
from elastic._shared.protocol import heal_env

SETTLE_SECONDS = 2.0
"""How long a survivor waits for members of the last view that neither arrived nor were marked failed:
survivors arrive as soon as their collective fails (before they tear anything down), within milliseconds
of each other on an idle machine; a dead worker's agent marks it within its monitor interval (0.5 s);
a lost node's workers are never marked, so a lost node costs this wait."""
GATHER_SECONDS = 10.0
"""How long the members of a closed view wait for each other before they give it up and shrink."""
LATEST_KEY = "view/latest"
HEARTBEAT_KEY = "view/heartbeat"
"""Counted up by rank 0 of the current view at every vote step: a worker waiting to join learns the group
still trains."""
_POLL_S = 0.005
_IDLE_POLL_S = 0.02
_MAX_MEMBERS = 1 << 16


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
    """Tickets of joiners (`register_joiner`) up to this one were considered for it or before it."""
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
    def parse(cls, number: int, text: str) -> View:
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
        if not 0 < len(members) <= _MAX_MEMBERS or len(set(ranks)) != len(ranks) or ranks != sorted(ranks):
            raise ViewError(f"view {number} in the store lists {len(members)} workers, not each rank once in order")
        return cls(number, members, int(considered), kind == "grow")


def first_view(world_size: int) -> View:
    """The round's start: every rank, incarnation 0."""
    return View(0, tuple(heal_env.member_id(rank, 0) for rank in range(world_size)))


def _members_key(number: int) -> str:
    return f"view/{number}/members"


def _arrivals_key(number: int) -> str:
    return f"view/{number}/arrivals"


def _arrival_key(number: int, ticket: int) -> str:
    return f"view/{number}/arrival/{ticket}"


def _joiner_key(ticket: int) -> str:
    return f"joiner/{ticket}"


def group_store(store: dist.Store, view: View) -> dist.Store:
    """Where the process group of `view` meets."""
    return dist.PrefixStore(f"view/{view.number}/group", store)


def read_view(store: dist.Store, number: int) -> View | None:
    """View `number` if it closed, else None (does not wait)."""
    key = _members_key(number)
    if not store.check([key]):
        return None
    return View.parse(number, store.get(key).decode(errors="replace"))


def latest(store: dist.Store) -> int:
    """The newest view closed in the round (0: none after the start)."""
    if not store.check([LATEST_KEY]):
        return 0
    raw = store.get(LATEST_KEY).decode(errors="replace")
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 18):
        raise ViewError(f"the round's newest view in the store is malformed: {raw[:40]!r}")
    return int(raw)


def _close(store: dist.Store, number: int, members: list[str], considered: int, *, grown: bool = False) -> View:
    """Close view `number` with `members` unless another worker closed it first; the view as closed."""
    ordered = sorted(set(members), key=lambda member: heal_env.parse_member_id(member))
    proposal = View(number, tuple(ordered), considered, grown).encode()
    closed = View.parse(number, store.compare_set(_members_key(number), "", proposal).decode(errors="replace"))
    while (newest := latest(store)) < number:  # LATEST_KEY only grows (a compare-and-set loop)
        store.compare_set(LATEST_KEY, str(newest) if newest else "", str(number))
    return closed


def _arrived(store: dist.Store, number: int) -> list[str]:
    """The members that arrived at view `number` so far (one whose id is not written yet is not counted)."""
    count = store.add(_arrivals_key(number), 0)
    keys = [_arrival_key(number, ticket) for ticket in range(1, count + 1)]
    return [store.get(key).decode(errors="replace") for key in keys if store.check([key])]


def arrive(store: dist.Store, last: View, me: str) -> None:
    """`me` survived `last`, which broke: count it in for the view after `last` (first thing, before any
    slow teardown, so that survivors arrive close together)."""
    number = last.number + 1
    ticket = store.add(_arrivals_key(number), 1)
    store.set(_arrival_key(number, ticket), me)


def failed(store: dist.Store, member: str) -> bool:
    """Whether `member`'s agent marked it failed (it replaces it: the worker, if alive, must leave)."""
    return store.check([heal_env.failed_key(member)])


def after_failure(
    store: dist.Store, last: View, me: str, *, settle: float = SETTLE_SECONDS, arrived_already: bool = False,
    leaving: Callable[[], bool] = lambda: False,
    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
) -> View | None:
    """The view after `last`, which broke: arrive at it (unless `arrive` did) and return it once closed
    (see the module docstring). It holds the members that arrived and were not marked failed, so it may
    not hold `me` (`me` came too late). None when `leaving()` turned true while it waited (this worker is
    being stopped: the caller marks it failed, and the view closes without it)."""
    number = last.number + 1
    if not arrived_already:
        arrive(store, last, me)
    deadline = clock() + settle
    while True:
        closed = read_view(store, number)
        if closed is not None:
            return closed
        if leaving():
            return None
        arrived = _arrived(store, number)
        waiting = [m for m in last.members if m not in arrived and not failed(store, m)]
        if not waiting or clock() >= deadline:
            alive = [m for m in arrived if not failed(store, m)]  # a worker its agent is stopping is not one
            if not alive:  # every one that came is being replaced: nobody closes an empty view
                raise ViewError(f"every worker that came to view {number} was marked failed")
            return _close(store, number, alive, last.considered)
        sleep(_POLL_S)


def joiners_waiting(store: dist.Store) -> int:
    """The newest joiner's ticket (the step vote carries it: rank 0 of a view reads it at each vote, and
    counts `HEARTBEAT_KEY` up: the group still trains)."""
    store.add(HEARTBEAT_KEY, 1)
    return store.add(heal_env.JOINERS_KEY, 0)


def admit(store: dist.Store, current: View, upto: int) -> View:
    """Rank 0 of `current`: close the next view as `current`'s members plus the joiners of tickets
    after `current.considered` up to `upto`, less those marked failed and any whose start rank is
    taken. A ticket whose id is still unwritten (its joiner died, or stopped, between taking it and
    writing it: the vote saw it a vote earlier) is voided with `VOID`; a joiner that finds its ticket
    voided takes another."""
    joiners, considered = [], current.considered
    taken = {heal_env.parse_member_id(member)[0] for member in current.members}
    for ticket in range(current.considered + 1, upto + 1):
        member = store.compare_set(_joiner_key(ticket), "", VOID).decode(errors="replace")
        considered = ticket
        if member == VOID:
            continue
        try:
            rank, _ = heal_env.parse_member_id(member)
        except ValueError:
            continue  # a malformed ticket is nobody's: skipped, never admitted
        if rank not in taken and not store.check([heal_env.failed_key(member)]):
            joiners.append(member)
            taken.add(rank)
    return _close(store, current.number + 1, [*current.members, *joiners], considered, grown=True)


def wait_view(store: dist.Store, number: int, *, timeout: float, clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep) -> View | None:
    """View `number` once closed; None after `timeout` seconds."""
    deadline = clock() + timeout
    while (view := read_view(store, number)) is None:
        if clock() >= deadline:
            return None
        sleep(_POLL_S)
    return view


VOID = "-"
"""A ticket that rank 0 found unwritten: nobody's."""


def register_joiner(store: dist.Store, me: str) -> int:
    """Wait to join: the ticket a grow admits `me` by."""
    while True:
        ticket = store.add(heal_env.JOINERS_KEY, 1)
        if store.compare_set(_joiner_key(ticket), "", me).decode(errors="replace") == me:
            return ticket  # (else rank 0 voided it in between: take another)


def wait_for_admission(
    store: dist.Store, me: str, *, after: int, ticket: int, first: View, stale_after: float,
    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
) -> View | None:
    """The first view after view `after` that holds `me`; None when the job ended first. A view that
    considered `ticket` without `me` passed it over: `me` takes a new ticket. `ViewError` when nobody
    is left to admit `me` (a new round restores the job): every member of the newest view (`first`:
    the round's start) was marked failed, or no vote counted `HEARTBEAT_KEY` up for `stale_after`
    seconds (a lost node's workers are never marked)."""
    seen = after
    checked_orphan = beat_seen_at = clock()
    beat = store.add(HEARTBEAT_KEY, 0)
    while True:
        if store.check([heal_env.ENDED_KEY]):
            return None
        newest = latest(store)
        if clock() - checked_orphan >= SETTLE_SECONDS:
            checked_orphan = clock()
            current = read_view(store, newest) if newest else first
            if current is not None and all(failed(store, m) for m in current.members):
                raise ViewError(f"every worker of view {newest} failed: none is left to take this one in")
            if (now_beat := store.add(HEARTBEAT_KEY, 0)) != beat:
                beat, beat_seen_at = now_beat, clock()
            elif clock() - beat_seen_at > stale_after:
                raise ViewError(f"no step vote for {stale_after:.0f} s: no group is left to take this one in")
        for number in range(seen + 1, newest + 1):
            view = read_view(store, number)
            if view is None:
                newest = number - 1  # closed, not yet noted as the newest: read it next time
                break
            if me in view.members:
                return view
            if view.considered >= ticket:
                ticket = register_joiner(store, me)
        seen = newest
        sleep(_IDLE_POLL_S)


def gather(store: dist.Store, view: View, *, timeout: float = GATHER_SECONDS,
           clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> bool:
    """Count this member present in `view` and wait for the others: True when the view forms, False when
    it was given up. One outcome for all (a compare-and-set): "formed" by the first member that saw
    every one present, or "given up" by the first whose `timeout` passed before; a member that gave
    up after another saw everyone still forms it (it had counted itself present)."""
    present, outcome = f"view/{view.number}/present", f"view/{view.number}/outcome"
    deadline = clock() + timeout
    count = store.add(present, 1)
    while True:
        if count >= view.world_size:
            return store.compare_set(outcome, "", "formed") == b"formed"
        if store.check([outcome]):
            return store.get(outcome) == b"formed"
        if clock() >= deadline:
            return store.compare_set(outcome, "", "given up") == b"formed"
        sleep(_POLL_S)
        count = store.add(present, 0)


def mark_ended(store: dist.Store) -> None:
    """The job finished: workers still waiting to join leave."""
    store.set(heal_env.ENDED_KEY, "1")
