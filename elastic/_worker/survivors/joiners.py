"""The joiners' side of the views (TORCHREVIVE_SURVIVORS=train-on): workers waiting to enter a
view, and the grow that takes them in (elastic._worker.survivors.views holds the views themselves).

A replacement, or a survivor that came too late for a shrink, waits to join: it takes a ticket
(`register_joiner`, a count in the store) and writes its id under it. Rank 0 of the current view
reads the newest ticket at each step vote (`joiners_waiting`) and, at a grow, closes the next
view as the current members plus the joiners of the tickets it saw (`admit`); the other members
read that view (`wait_view`). Which tickets a view considered travels with it, so a joiner passed
over by a shrink that closed first is admitted by a later grow. A joiner waits for the view that
holds it (`wait_for_admission`) until the job ends (`mark_ended`).

Invariants:
- A grow considers at most the round's world size of tickets (`admit`): the count is anyone's to raise.
- A ticket admits one worker at most: rank 0 voids an unwritten one (`VOID`) by a compare-and-set,
  and a joiner that finds its ticket voided takes another.
- Nothing here waits without bound but `wait_for_admission`, which also ends when the job ended
  (`heal_env.ENDED_KEY`), or when nobody is left to admit it (`ViewError`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from elastic._shared.protocol import heal_env
from elastic._shared.storage.store_records import Records
from elastic._worker.survivors.views import (
    SETTLE_SECONDS,
    View,
    ViewError,
    backoff,
    close_view,
    failed,
    latest,
    read_view,
)
from elastic._worker.timings import JOIN_IDLE_POLL_S as _IDLE_POLL_S

HEARTBEAT_KEY = "view/heartbeat"
"""Counted up by rank 0 of the current view at every vote step: a worker waiting to join learns the group
still trains."""


def _joiner_key(ticket: int) -> str:
    return f"joiner/{ticket}"


def joiners_waiting(records: Records) -> int:
    """The newest joiner's ticket (the step vote carries it: rank 0 of a view reads it at each vote, and
    counts `HEARTBEAT_KEY` up: the group still trains). A counter: `admit` bounds what it does with it."""
    records.store.add(HEARTBEAT_KEY, 1)
    return records.store.add(heal_env.JOINERS_KEY, 0)


def admit(records: Records, current: View, upto: int) -> View:
    """Rank 0 of `current`: close the next view as `current`'s members plus the joiners of tickets
    after `current.considered` up to `upto`, less those marked failed and any whose start rank is
    taken. A ticket whose id is still unwritten (its joiner died, or stopped, between taking it and
    writing it: the vote saw it a vote earlier) is voided with `VOID`; a joiner that finds its ticket
    voided takes another. At most the round's world size of tickets are considered per grow (the
    count is anyone's to raise): the rest wait for the next grow, and a count beyond that is warned of."""
    joiners, considered = [], current.considered
    taken = {heal_env.parse_member_id(member)[0] for member in current.members}
    if upto - considered > records.world:
        records.warn_once(heal_env.JOINERS_KEY, f"counts {upto - considered} workers waiting to join a round "
                          f"of {records.world}: {records.world} considered per grow")
        upto = considered + records.world
    for ticket in range(current.considered + 1, upto + 1):
        member = records.compare_set(_joiner_key(ticket), VOID)
        considered = ticket
        if member is None or member == VOID:
            continue
        try:
            rank, _ = heal_env.parse_member_id(member)
        except ValueError:
            continue  # a malformed ticket is nobody's: skipped, never admitted
        if rank < records.world and rank not in taken and not failed(records, member):
            joiners.append(member)
            taken.add(rank)
    return close_view(records, current.number + 1, [*current.members, *joiners], considered, grown=True)


def wait_view(records: Records, number: int, *, timeout: float, clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep) -> View | None:
    """View `number` once closed; None after `timeout` seconds."""
    deadline, attempt = clock() + timeout, 0
    while (view := read_view(records, number)) is None:
        if clock() >= deadline:
            return None
        sleep(backoff(attempt))
        attempt += 1
    return view


VOID = "-"
"""A ticket that rank 0 found unwritten: nobody's."""


def register_joiner(records: Records, me: str) -> int:
    """Wait to join: the ticket a grow admits `me` by (`ViewError` when every try found its ticket taken:
    rank 0 voids one only per grow, so only another process's writes take that many)."""
    for _ in range(4 * records.world + 4):
        ticket = records.store.add(heal_env.JOINERS_KEY, 1)
        if records.compare_set(_joiner_key(ticket), me) == me:
            return ticket  # (else rank 0 voided it in between: take another)
    raise ViewError(f"{4 * records.world + 4} tickets to join were taken by others: the rendezvous store is not the job's alone")


def wait_for_admission(
    records: Records, me: str, *, after: int, ticket: int, first: View, stale_after: float,
    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
) -> View | None:
    """The first view after view `after` that holds `me`; None when the job ended first. A view that
    considered `ticket` without `me` passed it over: `me` takes a new ticket. `ViewError` when nobody
    is left to admit `me` (a new round restores the job): every member of the newest view (`first`:
    the round's start) was marked failed, or no vote counted `HEARTBEAT_KEY` up for `stale_after`
    seconds (a lost node's workers are never marked)."""
    seen = after
    beat_seen_at = clock()
    # The first look for an orphaned view is at once: when two kills came together (every member of the
    # view gone before this joiner started), waiting out SETTLE_SECONDS first delayed the round by ~2 s.
    checked_orphan = beat_seen_at - SETTLE_SECONDS
    store = records.store
    beat = store.add(HEARTBEAT_KEY, 0)
    while True:
        if records.get(heal_env.ENDED_KEY) == "1":
            return None
        newest = latest(records)
        if clock() - checked_orphan >= SETTLE_SECONDS:
            checked_orphan = clock()
            current = read_view(records, newest) if newest else first
            if current is not None and all(failed(records, m) for m in current.members):
                raise ViewError(f"every worker of view {newest} failed: none is left to take this one in")
            if (now_beat := store.add(HEARTBEAT_KEY, 0)) != beat:
                beat, beat_seen_at = now_beat, clock()
            elif clock() - beat_seen_at > stale_after:
                raise ViewError(f"no step vote for {stale_after:.0f} s: no group is left to take this one in")
        for number in range(seen + 1, newest + 1):
            view = read_view(records, number)
            if view is None:
                newest = number - 1  # closed, not yet noted as the newest: read it next time
                break
            if me in view.members:
                return view
            if view.considered >= ticket:
                ticket = register_joiner(records, me)
        seen = newest
        sleep(_IDLE_POLL_S)


def mark_ended(records: Records) -> None:
    """The job finished: workers still waiting to join leave."""
    records.set(heal_env.ENDED_KEY, "1")
