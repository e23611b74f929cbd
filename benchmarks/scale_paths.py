"""The simulator's paths that go through a store, one adapter each: the project's real code per rank.

Each adapter is `body(sl, rank)`, run on a thread per simulated rank (scale_sim.run_threads), and says
what it counts in named phases (`sl.begin` / `sl.end`). It calls the real functions of one path, so
when that code changes only the adapter's few calls may need to follow:

- `hang`: a hang's comparison (elastic._worker.control.hang_names.HangNamer) with one silent rank
  (stopped after its start: it never looks again). Looks are rounds on a simulated clock: a round
  every `HANG_POLL` simulated seconds (the watchdog's look), stalled from 0. Phases: `arm` (the first
  look: once per group), `idle` (looks before the stall is old enough: the steady state between
  failures), `look` (every look of the comparison; the elected reader's are its aggregator's).
- `views`: train-on after a lost node (elastic._worker.survivors.views, .joiners): the survivors' shrink
  (`leave`: arrive, the view after the failure, its forming), then the node's replacements joining
  (`join`: tickets, rank 0's admission at a vote, every member's wait and the new view's forming).
- `notice-board`: one agent posts a failure, every agent reads it (`read`: elastic._agent.launcher.
  notice_board.StoreBoard.read_new and the claim of its event), then one idle look (`idle`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch.distributed as dist
from scale_sim import Slice

from elastic._agent.launcher.notice_board import Entry, StoreBoard
from elastic._shared.protocol import heal_env
from elastic._shared.storage.peer_auth import PeerKey
from elastic._shared.storage.store_records import Records
from elastic._worker.control.collective_record import CollectiveRecord
from elastic._worker.control.hang_names import HangNamer, Place
from elastic._worker.survivors import joiners, views

HANG_NAME_AFTER = 4.0
"""Simulated seconds of stall before the comparison (a fifth of a --hang-timeout of 20 s)."""
HANG_POLL = 1.0
"""Simulated seconds between looks (the watchdog's poll, at most 1 s)."""
NODE_RANKS = 8
"""Ranks per simulated node (GPUs per host)."""


def node_of(rank: int) -> str:
    return f"node{rank // NODE_RANKS}"


# -- hang naming ---------------------------------------------------------------------------------------


def hang(sl: Slice, rank: int) -> None:
    n, silent = sl.n, sl.params.get("silent", sl.n // 2)
    store = dist.PrefixStore("torchrevive/round/sim/", sl.client(rank))  # the default group's store

    def now() -> float:
        return sl.shared.get("now", 0.0)

    record = CollectiveRecord(clock=now)
    record.leave(record.enter("step vote", 20))
    record.enter("train step", 21)  # every rank waits inside step 21's collective; the silent one stopped there
    reports: list[Any] = []
    namer = HangNamer(record, name_after=HANG_NAME_AFTER, gather=HANG_NAME_AFTER, store=lambda: store,
                      place=lambda: Place(rank, n, node_of(rank), f"host-{node_of(rank)}"), report=reports.append,
                      main_thread=None, clock=now)
    looks = int(2 * HANG_NAME_AFTER / HANG_POLL) + 3
    for look in range(looks):
        sl.barrier(f"hang-{look}", action=lambda look=look: sl.shared.__setitem__("now", look * HANG_POLL))
        if look > 0 and rank == silent:
            continue  # stopped: its thread never runs again
        stalled = look * HANG_POLL
        phase = "arm" if look == 0 else "look" if stalled >= HANG_NAME_AFTER else "idle"
        started = time.perf_counter()
        sl.begin(phase, rank)
        namer.look(stalled, (0, 21, False))
        sl.end(phase, rank)
        if phase == "idle":
            sl.note("idle", "idle_looks", 1)
        if phase == "look":
            sl.note("look", "looks", 1)
            sl.note("look", "look_seconds", [time.perf_counter() - started])
            if reader_of(namer):
                sl.note("look", "reader_ranks", [rank])
    sl.note("look", "verdicts", [v.culprits_ranks() for v in reports])


def reader_of(namer: HangNamer) -> bool:
    """Whether `namer` is its comparison's elected reader (False for a code that elects none)."""
    return bool(namer.is_reader)


# -- train-on views ------------------------------------------------------------------------------------


def _records(sl: Slice, rank: int) -> Records:
    scope = "torchrevive/heal/sim/"
    store = dist.PrefixStore(scope, sl.client(rank))
    return Records(store, key=PeerKey.from_env(os.environ), scope=scope, world=sl.n)


def views_path(sl: Slice, rank: int) -> None:
    n = sl.n
    lost = range(n - NODE_RANKS, n)  # the last node is lost: its workers never arrive, nor are marked failed
    records = _records(sl, rank)
    first = views.first_view(n)
    sl.barrier("views-start")
    if rank in lost:
        joiner = heal_env.member_id(rank, 1)  # its replacement, once the node is back
        sl.barrier("views-shrunk")
        sl.begin("join", rank)
        after = views.latest(records)
        ticket = joiners.register_joiner(records, joiner)
        sl.end("join", rank)
        sl.barrier("views-registered")
        sl.begin("join", rank)
        view = joiners.wait_for_admission(records, joiner, after=after, ticket=ticket, first=first, stale_after=120)
        assert view is not None and joiner in view.members, "a replacement was not admitted"
        assert views.gather(records, view, joiner), "the grown view did not form"
        sl.end("join", rank)
        return
    me = heal_env.member_id(rank, 0)
    sl.begin("leave", rank)
    views.arrive(records, first, me)
    shrunk = views.after_failure(records, first, me, arrived_already=True)
    assert shrunk is not None and shrunk.members == first.members[: n - NODE_RANKS], "the shrink lost a survivor"
    assert views.gather(records, shrunk, me), "the shrunk view did not form"
    sl.end("leave", rank)
    sl.barrier("views-shrunk")
    sl.barrier("views-registered")
    sl.begin("join", rank)
    if shrunk.rank_of(me) == 0:  # its step vote carries the newest ticket
        grown = joiners.admit(records, shrunk, joiners.joiners_waiting(records))
    else:
        grown = joiners.wait_view(records, shrunk.number + 1, timeout=120)
    assert grown is not None and len(grown.members) == n, "the grow did not admit every replacement"
    assert views.gather(records, grown, me), "the grown view did not form"
    sl.end("join", rank)


# -- the notice board ----------------------------------------------------------------------------------


def notice_board(sl: Slice, rank: int) -> None:
    board = StoreBoard(sl.client(rank), "sim")
    sl.barrier("board-start")
    if rank == 0:
        sl.begin("post", rank)
        board.post(Entry("failure", "failure: worker rank 3 on node node0 was killed", time.time(), 20, sl.n, "node0",
                         {"rank": 3}))
        sl.end("post", rank)
    sl.barrier("board-posted")
    sl.begin("read", rank)
    read: list[Any] = []
    while not read:
        read = board.read_new()
    for number, _ in read:
        board.claim(number)  # the first agent to claim it writes the event
    sl.end("read", rank)
    sl.begin("idle", rank)
    board.read_new()  # an agent's look with nothing new
    sl.end("idle", rank)
    sl.note("read", "entries", [len(read)])


PATHS = {"hang": hang, "views": views_path, "notice-board": notice_board}
