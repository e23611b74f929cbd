"""Naming a hang costs every rank a few store operations per look, whatever the job's size: counted, at two
sizes (a comparison where every rank read every peer's record grew as N per rank, N^2 per look)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from test_hang_culprits import DictStore

from elastic._worker.control.collective_record import CollectiveRecord
from elastic._worker.control.culprits import NO_ANSWER
from elastic._worker.control.hang_names import BATCH, PREFIX, HangNamer, Place


class Counted:
    """One rank's view of the shared store, counting its operations."""

    def __init__(self, store: DictStore, counts: Counter, rank: int) -> None:
        self.store, self.counts, self.rank = store, counts, rank

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any) -> Any:
            self.counts[self.rank] += 1
            return method(*args)

        return counted


def comparison(world: int, *, silent: int, looks: int = 12, stall_from: float = 0.0,
               store: DictStore | None = None, seq_step: int = 21, progress: object = 20,
               made: list[tuple[HangNamer, CollectiveRecord]] | None = None,
               never_armed: bool = False) -> tuple[list[Any], Counter, list[Counter], Any]:
    """`world` ranks, `silent` stops after its first look (`never_armed`: before it); every rank inside step
    `seq_step`'s collective.
    Returns (reports, operations per rank over the stalled looks, operations per rank of each stalled
    look, the namers)."""
    store = store if store is not None else DictStore()
    now, reports = [0.0], []
    counts: Counter = Counter()
    if made is None:
        made = []
        for rank in range(world):
            kept = CollectiveRecord(clock=lambda: now[0])
            kept.leave(kept.enter("step vote", seq_step - 1))
            view = Counted(store, counts, rank)
            namer = HangNamer(kept, name_after=3.0, gather=3.0, store=lambda view=view: view,
                              place=lambda rank=rank: Place(rank, world, f"node{rank}", "host"), report=reports.append,
                              main_thread=None, clock=lambda: now[0])
            made.append((namer, kept))
    else:
        for namer, _ in made:
            namer._report = reports.append
            namer._clock = lambda: now[0]
    for _, kept in made:
        kept.enter("train step", seq_step)
    per_look: list[Counter] = []
    for tick in range(looks):
        now[0] = stall_from + tick
        before = Counter(counts)
        for rank, (namer, _) in enumerate(made):
            if rank != silent or (tick == 0 and not never_armed):
                namer.look(float(tick), progress=progress)
        if tick >= 3:  # stalled past name_after: the comparison's looks
            per_look.append(counts - before)
    total = Counter()
    for look in per_look:
        total.update(look)
    return reports, total, per_look, made


def test_a_look_costs_a_rank_at_most_four_store_operations_at_any_size_and_one_reader_reads_in_batches() -> None:
    reader_reads = {}
    for world in (8, 96):
        reports, total, per_look, made = comparison(world, silent=world // 2)
        assert [r.culprits_ranks() for r in reports] == [[world // 2]], world
        readers = [rank for rank, (namer, _) in enumerate(made) if namer.is_reader]
        assert len(readers) == 1, readers
        for look in per_look:
            assert max((ops for rank, ops in look.items() if rank not in readers), default=0) <= 4, (world, look)
        reader_reads[world] = total[readers[0]]
        assert all(namer.verdicts and namer.verdicts[0].culprits_ranks() == [world // 2]
                   for rank, (namer, _) in enumerate(made) if rank != world // 2), "every rank that talks learns it"
    # The reader reads every record twice per stall, BATCH at a time (a check and a multi_get each):
    # linear in the job's size once, never a rank's reads per peer per look.
    assert reader_reads[96] <= reader_reads[8] + 4 * (96 // BATCH + 1) + 4 * 12, reader_reads


def test_the_whole_jobs_operations_per_look_grow_linearly_not_quadratically() -> None:
    totals = {}
    for world in (8, 64):
        _, total, per_look, _ = comparison(world, silent=1)
        totals[world] = sum(total.values()) / len(per_look)
    assert totals[64] / totals[8] <= 1.5 * 64 / 8, totals  # quadratic growth would be 64 times


def test_a_second_stall_in_the_same_group_is_judged_on_counters_that_only_grow() -> None:
    """A rank that published often in a first comparison (every rank waited in the same collective: no
    culprit) is not named silent in the next one because its counter started again below what the reader
    read first."""
    store = DictStore()
    reports, _, _, made = comparison(3, silent=-1, looks=12, store=store)
    assert [r.culprits_ranks() for r in reports] == [[]]
    for _, kept in made:
        kept.leave(kept.newest().seq)  # the step completed: progress
    reports, _, _, _ = comparison(3, silent=2, looks=12, stall_from=100.0, store=store, seq_step=23, progress=22,
                                  made=made)
    assert [r.culprits_ranks() for r in reports] == [[2]]
    assert reports[0].culprits[0].why == NO_ANSWER


def test_a_rank_that_never_said_anything_is_named_and_no_read_waits_for_its_key() -> None:
    """Its record is missing: the batch holding it is checked and split, never read whole (a read of a
    missing key would block until the store's timeout)."""

    class Strict(DictStore):
        def multi_get(self, keys: list[str]) -> list[bytes]:
            assert all(key in self.values for key in keys), "a multi_get of a key that is not there"
            return super().multi_get(keys)

    reports, _, _, _ = comparison(20, silent=7, store=Strict(), never_armed=True)
    assert [r.culprits_ranks() for r in reports] == [[7]]
    assert reports[0].culprits[0].node == ""  # it never said where it runs
