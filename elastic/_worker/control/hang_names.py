"""Naming a hang's culprit: on a stall well under --hang-timeout, the ranks that can still talk compare records.

Each rank's watchdog thread (elastic._worker.control.watchdog) calls `HangNamer.look()` at every poll.
Once this rank's training has made no progress for `name_after` seconds (a fifth of --hang-timeout), it
takes part in a comparison through the job's store (the default process group's, keys under `PREFIX`).
One rank reads everybody's record and the others read one key, so a look costs every rank a few store
operations whatever the job's size (at 4,096 ranks, every rank reading every peer was 16.8 M gets a look):

1. at its first look (armed) each rank publishes its record (`culprits.RankRecord`: its newest
   collective, whether it is inside it, its last completed one, its main thread's stack top, where it
   runs) as `rec/RANK`, once per group: a rank that stops later is still known, and where it ran;
2. while stalled it publishes its record again at every look, with a counter (`n`) that only grows:
   a peer whose counter moves during the comparison can still talk;
3. at its first stalled look it claims the reading of its stall (`lead/SEQ`, compare-and-set; SEQ is
   its newest collective's sequence number, the same on every rank that waits in the same collective):
   the first to claim is the stall's reader. The reader reads every record in batches (`check`, then
   `multi_get`, `BATCH` keys a call) at its first look and again `gather` seconds later, and names the
   culprits from the records of the ranks that talked (`culprits.name_culprits`) unless its own training
   moved meanwhile (no hang: nothing is said);
4. the reader publishes the verdict (`verdict/SEQ`, compare-and-set) and, unless it is named itself,
   reports it (`report`: a note for its agent, who prints it on every agent and writes the `hang`
   event); every other rank reads that one key at each look (`check`, then `get` once it is there),
   and an answering culprit that reads itself named dumps its Python stacks to stderr with faulthandler.

Costs: a look costs a rank that does not read at most 3 store operations (its record, the verdict's
`check`, its `get` once), its first stalled look 2 (its record, the claim); the reader adds
2 x ceil(N / `BATCH`) reads per comparison (the one aggregator: O(N) bytes, twice per stall). A
culprit that still talks (behind the others: another SEQ) reads for its own SEQ: the only other reader.

Invariants: a comparison happens at most once per stall (a new one only after this rank's progress
moved); every value goes into the store sealed with the job's secret (TORCHREVIVE_SNAPSHOT_SECRET_FILE,
elastic._shared.storage.store_records: a stranger cannot name a false culprit, whose agent would end
it, nor claim a stall's reading), every read is `check` before `get` or `multi_get` (no call waits on a
key that is not there) and every value read is verified, bounded and parsed (`culprits.RankRecord.parse`,
`_envelope`, `_summary`); nothing here raises into the watchdog thread: a store that fails ends this
comparison with one warning. The watchdog's own exit at --hang-timeout is untouched: naming comes first
(at most `name_after + gather`, two fifths of it). A reader that dies mid-comparison leaves its stall
unnamed; the watchdog still ends the job's wait at --hang-timeout.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import sysconfig
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from elastic._shared.protocol import worker_notes
from elastic._shared.storage.peer_auth import PeerKey, SecretError
from elastic._shared.storage.store_batches import BATCH, read_present
from elastic._shared.storage.store_records import Records
from elastic._worker.control.collective_record import CollectiveRecord
from elastic._worker.control.culprits import (
    MAX_RECORD,
    NO_ANSWER,
    Culprit,
    RankRecord,
    Verdict,
    name_culprits,
)
from elastic._worker.runtime.worker_env import WorkerEnv

logger = logging.getLogger(__name__)

PREFIX = "torchrevive/hang/"
_UNREAD = object()
NAME_FRACTION = 5
"""A stall is compared after --hang-timeout / NAME_FRACTION seconds, for at most as long again."""
MAX_NAMED = 128
"""Culprits a published verdict lists (a bounded record: every rank reads it)."""


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
class _Comparison:
    progress: object
    seq: int
    """This rank's newest collective when the stall began: the stall's keys are under it."""
    deadline: float
    reader: bool | None = None
    """Whether this rank reads the records (None: not claimed yet)."""
    first: dict[int, tuple[int, RankRecord]] = field(default_factory=dict)
    """The reader's first read: each rank's counter and record then."""
    done: bool = False
    since: float = 0.0
    """When the stall it compares began, in seconds since the epoch (`Verdict.since`)."""


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


def _summary(verdict: Verdict, reader: int) -> str:
    """The verdict every rank reads: who read it, the collective, the culprits (at most MAX_NAMED)."""
    named = [[c.rank, "silent" if c.why == NO_ANSWER else "behind"] for c in verdict.culprits[:MAX_NAMED]]
    return json.dumps({"by": reader, "c": verdict.collective[:240], "s": verdict.step, "k": named}, separators=(",", ":"))


def _parse_summary(text: str, world_size: int) -> Verdict | None:
    """A published verdict as a `Verdict` of ranks and reasons only; None for anything else."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or set(value) != {"by", "c", "s", "k"} or not isinstance(value["c"], str):
        return None
    if type(value["s"]) is not int or not isinstance(value["k"], list) or len(value["k"]) > MAX_NAMED:
        return None
    culprits = []
    for item in value["k"]:
        if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int and 0 <= item[0] < world_size
                and item[1] in ("silent", "behind")):
            return None
        why = NO_ANSWER if item[1] == "silent" else "never entered it"
        culprits.append(Culprit(item[0], why, "", "", "", ""))
    return Verdict(collective=value["c"], step=value["s"], culprits=tuple(culprits), answered=())


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


def read_records(records: Records, world_size: int, skip: int) -> dict[int, tuple[int, RankRecord]]:
    """Every rank's published record but `skip`'s: (counter, record) by rank, for the ranks that have a
    valid one (store_batches: checked batches of `BATCH` keys, no read waits on a key never written)."""
    names = {f"{PREFIX}rec/{rank}": rank for rank in range(world_size) if rank != skip}
    found: dict[int, tuple[int, RankRecord]] = {}
    for name, raw in read_present(records.store, list(names), BATCH).items():
        text = records.open(name, raw)
        parsed = _envelope(text.encode(), world_size) if text is not None else None
        if parsed is not None and parsed[1].rank == names[name]:
            found[names[name]] = parsed
    return found


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
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`store`: the store to compare through (called at each comparison; None: none now);
        `place`: this rank now (None: not in a group); `report`: what the reader does with the verdict;
        `main_thread`: the thread whose stack top is published; `environ`: the worker's parsed environment
        (`ctx.env.variables`), which names the job's secret the records are sealed with (None: unsealed)."""
        self._environ: Mapping[str, str] = environ if environ is not None else {}
        self._record = record
        self.name_after = name_after
        self.gather = gather
        self._store = store
        self._place = place
        self._report = report
        self._main_thread = main_thread
        self._clock = clock
        self._comparison: _Comparison | None = None
        self._armed: tuple[int, int, int] | None = None
        self._counter = 0  # only grows: a peer's counter that moved is a peer that talked
        self._key: Any = _UNREAD
        self._records: Records | None = None
        self.verdicts: list[Verdict] = []
        """The verdicts this rank computed (the reader) or read (the others: ranks and reasons only)."""

    @property
    def is_reader(self) -> bool:
        """Whether this rank reads the records of its current (or last) comparison."""
        return bool(self._comparison is not None and self._comparison.reader)

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
        records = self._sealed(store)
        if self._armed != (place.rank, place.world_size, id(records.store)):  # once per group, before any stall
            self._publish(records, place)
            self._armed = (place.rank, place.world_size, id(records.store))
        if stalled is None:
            return
        comparison = self._comparison
        if comparison is not None and comparison.progress != progress:
            comparison = self._comparison = None  # it moved: a new stall may come
        if stalled < self.name_after:
            return
        now = self._clock()
        if comparison is None:
            newest = self._record.newest()
            # `since` is when the stall began, not this look: a look that comes late (a loaded host) must not
            # date the stall after a replacement that started during it, which would then be ended for it.
            comparison = self._comparison = _Comparison(progress, newest.seq if newest else 0, now + self.gather,
                                                        since=time.time() - stalled)
        if comparison.done:
            return
        self._publish(records, place)
        if comparison.reader is None:
            claim = records.compare_set(f"{PREFIX}lead/{comparison.seq}", str(place.rank))
            comparison.reader = claim == str(place.rank)
            if comparison.reader:
                comparison.first = read_records(records, place.world_size, place.rank)
            return
        if comparison.reader:
            if now >= comparison.deadline:
                self._decide(records, place, comparison)
            return
        text = records.get(f"{PREFIX}verdict/{comparison.seq}")
        verdict = _parse_summary(text, place.world_size) if text is not None else None
        if verdict is not None:
            comparison.done = True
            self.verdicts.append(verdict)
            if place.rank in verdict.culprits_ranks():
                self._named(place)

    def _publish(self, records: Records, place: Place) -> None:
        self._counter += 1
        mine = self._own_record(place)
        records.set(f"{PREFIX}rec/{place.rank}", json.dumps({"n": self._counter, "r": mine.dumps()}))

    def _decide(self, records: Records, place: Place, comparison: _Comparison) -> None:
        """The reader, `gather` seconds after its first read: read again, name the culprits from the ranks
        whose counter moved, publish the verdict and report it."""
        comparison.done = True
        last = read_records(records, place.world_size, place.rank)
        talked: dict[int, RankRecord | None] = {place.rank: self._own_record(place)}
        whereabouts: dict[int, tuple[str, str]] = {}
        for rank, (counter, record) in last.items():
            first = comparison.first.get(rank)
            if first is None or counter > first[0]:
                talked[rank] = record
            else:  # its record is the one it left when it last talked: where it runs, not what it does now
                whereabouts[rank] = (record.node, record.host)
        verdict = replace(name_culprits(talked, place.world_size, whereabouts), since=comparison.since)
        self.verdicts.append(verdict)
        summary = _summary(verdict, place.rank)
        named = place.rank in verdict.culprits_ranks()
        if records.compare_set(f"{PREFIX}verdict/{comparison.seq}", summary) == summary and not named:
            self._report(verdict)  # a reader that is itself behind reads for its own stall: the front reports
        if named:
            self._named(place)

    @staticmethod
    def _named(place: Place) -> None:
        print(f"hang: this rank ({place.rank}) is named as the culprit; its Python stacks:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    def _sealed(self, store: Any) -> Records:
        """`store` with every value sealed with the job's secret and checked when read (a stranger's
        record would name a false culprit, whose agent then ends it)."""
        if self._records is None or self._records.store is not store:
            if self._key is _UNREAD:
                try:
                    self._key = PeerKey.from_env(self._environ)
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


def default_store() -> Any:
    """The store of the default process group (this round's), or None outside one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


def this_rank(env: WorkerEnv) -> Place | None:
    """This rank in the default group, and where it runs: its agent's node name (the snapshot keeper's,
    when there is one; else the host name) and the host name (`env`: the worker's, read when it opened)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return Place(dist.get_rank(), dist.get_world_size(), env.node[:200], env.host[:200])


def report_to_agent(verdict: Verdict, env: WorkerEnv) -> None:
    """The winner's verdict: a note for this node's agent, which prints it on every agent and writes the
    `hang` event; without an agent that takes notes (plain torchrun), the line on this worker's stderr."""
    directory, local_rank = env.notes_dir, env.local_rank
    note = {"line": verdict.line(), "step": verdict.step, **verdict.fields()}
    if directory and local_rank is not None and worker_notes.write_json(worker_notes.hang_path(directory, local_rank), note):
        return
    print(f"torchrevive: {verdict.line()}", file=sys.stderr, flush=True)
