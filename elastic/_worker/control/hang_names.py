"""Naming a hang's culprit: on a stall well under --hang-timeout, the ranks that can still talk compare records.

Each rank's watchdog thread (elastic._worker.control.watchdog) calls `HangNamer.look()` at every poll.
Once this rank's training has made no progress for `name_after` seconds (a fifth of --hang-timeout), it
takes part in a comparison through the job's store (the default process group's, keys under `PREFIX`):

1. at its first look (armed) each rank writes where it runs, `who/RANK` = [node, host], once;
2. while stalled it publishes its record (`culprits.RankRecord`: its newest collective, whether it is
   inside it, its last completed one, its main thread's stack top) as `rec/RANK`, with a counter
   it raises at every look: a peer whose counter moves during the comparison can still talk;
3. after `gather` seconds of reading every peer's record it names the culprits from the records of
   the ranks that talked (`culprits.name_culprits`), unless its own training moved meanwhile (no hang:
   nothing is said);
4. the first rank to set `verdict` (compare-and-set) reports it (`report`: a note for its agent, who
   prints it on every agent and writes the `hang` event), and every answering culprit that reads itself
   named dumps its Python stacks to stderr with faulthandler.

Invariants: a comparison happens at most once per stall (a new one only after this rank's progress
moved); every value goes into the store sealed with the job's secret (TORCHREVIVE_SNAPSHOT_SECRET_FILE,
elastic._shared.storage.store_records: a stranger cannot name a false culprit, whose agent would end
it), every read is `check` before `get` (no call waits on a key that is not there) and every value
read is verified, bounded and parsed (`culprits.RankRecord.parse`, `_envelope`); nothing here raises into the
watchdog thread: a store that fails ends this comparison with one warning. The watchdog's own exit at
--hang-timeout is untouched: naming comes first (at most `name_after + gather`, two fifths of it).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic._shared.protocol import worker_notes
from elastic._shared.storage.keeper_address import NODE_ENV
from elastic._shared.storage.peer_auth import PeerKey, SecretError
from elastic._shared.storage.store_records import Records
from elastic._worker.control.collective_record import CollectiveRecord
from elastic._worker.control.culprits import (
    MAX_RECORD,
    RankRecord,
    Verdict,
    name_culprits,
)

logger = logging.getLogger(__name__)

PREFIX = "torchrevive/hang/"
_UNREAD = object()
NAME_FRACTION = 5
"""A stall is compared after --hang-timeout / NAME_FRACTION seconds, for at most as long again."""


def name_after(hang_timeout: float) -> float:
    """Seconds of stall before the ranks compare records: a fifth of --hang-timeout."""
    return hang_timeout / NAME_FRACTION


@dataclass(frozen=True)
class Place:
    """Where this rank runs, and who it is in the job now."""

    rank: int
    world_size: int
    node: str
    host: str


@dataclass
class _Peer:
    first: int | None
    """The counter of its record at the comparison's first read (None: no record then)."""
    last: int | None = None
    record: RankRecord | None = None


@dataclass
class _Comparison:
    progress: object
    deadline: float
    counter: int = 0
    peers: dict[int, _Peer] = field(default_factory=dict)
    done: bool = False


def _envelope(raw: bytes, world_size: int) -> tuple[int, RankRecord] | None:
    """A published record: {"n": counter, "r": record}; None for anything else."""
    if len(raw) > MAX_RECORD + 64:
        return None
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(value, dict) or set(value) != {"n", "r"} or type(value["n"]) is not int or not isinstance(value["r"], str):
        return None
    record = RankRecord.parse(value["r"], world_size=world_size)
    return (value["n"], record) if record is not None else None


def _whereabouts(raw: bytes) -> tuple[str, str] | None:
    if len(raw) > 600:
        return None
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) and len(v) <= 240 for v in value):
        return value[0], value[1]
    return None


def stack_top(thread_ident: int | None) -> str:
    """Where thread `thread_ident` is: its innermost frame outside Python's own library ("file:line in
    function"), and the library call it waits in when that is deeper ("... (in threading.py:327 wait)");
    "" when unknown."""
    frame = sys._current_frames().get(thread_ident) if thread_ident is not None else None
    if frame is None:
        return ""
    innermost = frame
    while frame is not None and _in_stdlib(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        frame = innermost
    where = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
    if frame is not innermost:
        where += f" (in {os.path.basename(innermost.f_code.co_filename)}:{innermost.f_lineno} {innermost.f_code.co_name})"
    return where


def _in_stdlib(filename: str) -> bool:
    return filename.startswith(_STDLIB) and "site-packages" not in filename


_STDLIB = sysconfig.get_paths()["stdlib"]


class HangNamer:
    """This rank's side of the comparison (see the module docstring)."""

    def __init__(
        self,
        record: CollectiveRecord,
        *,
        name_after: float,
        gather: float,
        store: Callable[[], Any],
        place: Callable[[], Place | None],
        report: Callable[[Verdict], None],
        main_thread: int | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`store`: the store to compare through (called at each comparison; None: none now);
        `place`: this rank now (None: not in a group); `report`: what the winner does with the verdict;
        `main_thread`: the thread whose stack top is published."""
        self._record = record
        self.name_after = name_after
        self.gather = gather
        self._store = store
        self._place = place
        self._report = report
        self._main_thread = main_thread
        self._clock = clock
        self._comparison: _Comparison | None = None
        self._said_where: tuple[int, int, int] | None = None
        self._key: Any = _UNREAD
        self._records: Records | None = None
        self.verdicts: list[Verdict] = []
        """The verdicts this rank computed (tests and the metrics read them)."""

    def look(self, stalled: float | None, progress: object) -> None:
        """One look: `stalled` is how long this rank made no progress (None: paused, or nothing yet),
        `progress` a mark that changes whenever it makes some (`Watchdog.stalled`)."""
        try:
            self._look(stalled, progress)
        except (RuntimeError, OSError, ValueError) as error:  # a store that failed: the watchdog still acts
            logger.warning("hang naming: the store failed (%s); no culprit is named for this stall", error)
            if self._comparison is not None:
                self._comparison.done = True

    def _look(self, stalled: float | None, progress: object) -> None:
        place = self._place()
        store = self._store() if place is not None else None
        if place is None or store is None:
            return
        store = self._sealed(store)
        if self._said_where != (place.rank, place.world_size, id(store.store)):  # once per group, before any stall
            store.set(f"{PREFIX}who/{place.rank}", json.dumps([place.node, place.host]))
            self._said_where = (place.rank, place.world_size, id(store.store))
        if stalled is None:
            return
        comparison = self._comparison
        if comparison is not None and comparison.progress != progress:
            comparison = self._comparison = None  # it moved: a new stall may come
        if stalled < self.name_after:
            return
        now = self._clock()
        if comparison is None:
            comparison = self._comparison = _Comparison(progress=progress, deadline=now + self.gather)
        if comparison.done:
            return
        comparison.counter += 1
        mine = self._own_record(place)
        store.set(f"{PREFIX}rec/{place.rank}", json.dumps({"n": comparison.counter, "r": mine.dumps()}))
        self._read_peers(store, place, comparison)
        if now < comparison.deadline:
            return
        comparison.done = True
        talked: dict[int, RankRecord | None] = {place.rank: mine}
        for rank, peer in comparison.peers.items():
            moved = peer.last is not None and (peer.first is None or peer.last > peer.first)
            if moved and peer.record is not None:
                talked[rank] = peer.record
        verdict = name_culprits(talked, place.world_size, self._whereabouts(store, place, talked))
        self.verdicts.append(verdict)
        mine_text = f"{place.rank}:{verdict.collective}:{','.join(map(str, verdict.culprits_ranks()))}"
        if store.compare_set(f"{PREFIX}verdict", mine_text) == mine_text:
            self._report(verdict)
        if place.rank in verdict.culprits_ranks():
            print(f"hang: this rank ({place.rank}) is named as the culprit; its Python stacks:", file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    def _sealed(self, store: Any) -> Records:
        """`store` with every value sealed with the job's secret and checked when read (a stranger's
        record would name a false culprit, whose agent then ends it)."""
        if self._records is None or self._records.store is not store:
            if self._key is _UNREAD:
                try:
                    self._key = PeerKey.from_env()
                except SecretError as error:
                    logger.warning("hang naming: its records go unsealed: %s", error)
                    self._key = None
            self._records = Records(store, key=self._key, scope=PREFIX)
        return self._records

    def _own_record(self, place: Place) -> RankRecord:
        newest, done = self._record.newest(), self._record.last_done()
        return RankRecord(
            rank=place.rank, seq=newest.seq if newest else 0, op=newest.op if newest else "",
            step=newest.step if newest else -1, inside=bool(newest and newest.left is None),
            last_done=done.describe() if done else "", stack_top=stack_top(self._main_thread),
            node=place.node, host=place.host,
        )

    def _read_peers(self, store: Any, place: Place, comparison: _Comparison) -> None:
        for rank in range(place.world_size):
            if rank == place.rank:
                continue
            key = f"{PREFIX}rec/{rank}"
            text = store.get(key)
            parsed = _envelope(text.encode(), place.world_size) if text is not None else None
            counter, record = parsed if parsed is not None and parsed[1].rank == rank else (None, None)
            peer = comparison.peers.setdefault(rank, _Peer(first=counter))  # the first read of this comparison
            if counter is not None:
                peer.last, peer.record = counter, record

    def _whereabouts(self, store: Any, place: Place, talked: dict[int, RankRecord | None]) -> dict[int, tuple[str, str]]:
        known: dict[int, tuple[str, str]] = {}
        for rank in range(place.world_size):
            key = f"{PREFIX}who/{rank}"
            text = store.get(key) if rank not in talked else None
            where = _whereabouts(text.encode()) if text is not None else None
            if where is not None:
                known[rank] = where
        return known


def default_store() -> Any:
    """The store of the default process group (this round's), or None outside one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


def this_rank() -> Place | None:
    """This rank in the default group, and where it runs: its agent's node name (the snapshot keeper's,
    when there is one; else the host name) and the host name."""
    import os
    import socket

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    host = socket.gethostname()
    node = os.environ.get(NODE_ENV) or host
    return Place(dist.get_rank(), dist.get_world_size(), node[:200], host[:200])


def report_to_agent(verdict: Verdict) -> None:
    """The winner's verdict: a note for this node's agent, which prints it on every agent and writes the
    `hang` event; without an agent that takes notes (plain torchrun), the line on this worker's stderr."""
    import os

    directory, local_rank = os.environ.get(worker_notes.NOTES_ENV), os.environ.get("LOCAL_RANK", "")
    note = {"line": verdict.line(), "step": verdict.step, **verdict.fields()}
    if directory and local_rank.isdigit() and worker_notes.write_json(worker_notes.hang_path(directory, int(local_rank)), note):
        return
    print(f"torchrevive: {verdict.line()}", file=sys.stderr, flush=True)
