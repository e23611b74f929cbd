"""Naming a hang's culprit: the verdict from the ranks' records, the record itself, and the comparison
through a store (a dict here, on a clock the test moves)."""

from __future__ import annotations

import json
import time
from typing import Any

from elastic._worker.control.collective_record import KEEP, CollectiveRecord
from elastic._worker.control.culprits import (
    MAX_RECORD,
    MAX_TEXT,
    NO_ANSWER,
    RankRecord,
    name_culprits,
)
from elastic._worker.control.hang_names import PREFIX, HangNamer, Place, name_after


def record(rank: int, seq: int, *, inside: bool, op: str = "train step", step: int = 21, top: str = "") -> RankRecord:
    return RankRecord(rank=rank, seq=seq, op=op, step=step, inside=inside, last_done="step vote at step 20",
                      stack_top=top, node=f"node{rank}", host=f"host{rank}")


def test_a_rank_that_never_entered_the_collective_the_others_wait_in_is_named() -> None:
    records = {
        0: record(0, 42, inside=True),
        1: record(1, 41, inside=False, op="step vote", step=20, top="faults.py:120 in at"),
        2: record(2, 42, inside=True),
    }
    verdict = name_culprits(records, 3)
    assert verdict.culprits_ranks() == [1]
    assert verdict.collective == "train step at step 21" and verdict.step == 21
    culprit = verdict.culprits[0]
    assert (culprit.node, culprit.host, culprit.stack_top) == ("node1", "host1", "faults.py:120 in at")
    assert "never entered it" in culprit.why and "step vote at step 20" in culprit.why
    line = verdict.line()
    assert "rank 1 on node node1 (host host1)" in line and "faults.py:120 in at" in line
    assert verdict.fields()["culprits"] == [1] and verdict.fields()["answered"] == [0, 1, 2]


def test_a_rank_that_does_not_answer_is_named_with_where_it_said_it_runs() -> None:
    verdict = name_culprits({0: record(0, 42, inside=True)}, 2, {1: ("node1", "host1")})
    assert verdict.culprits_ranks() == [1]
    assert verdict.culprits[0].why == NO_ANSWER and verdict.culprits[0].node == "node1"


def test_a_silent_rank_and_one_behind_are_both_named() -> None:
    verdict = name_culprits({0: record(0, 42, inside=True), 1: record(1, 40, inside=False)}, 3)
    assert verdict.culprits_ranks() == [1, 2]


def test_every_rank_inside_the_same_collective_names_no_one() -> None:
    verdict = name_culprits({0: record(0, 42, inside=True), 1: record(1, 42, inside=True)}, 2)
    assert verdict.culprits == ()
    assert "no culprit is named" in verdict.line()


def test_a_record_round_trips_and_anything_else_is_refused() -> None:
    good = record(1, 7, inside=True, top="x.py:1 in f")
    assert RankRecord.parse(good.dumps(), world_size=2) == good
    assert RankRecord.parse(good.dumps(), world_size=1) is None  # a rank beyond the world
    raw = json.loads(good.dumps())
    for bad in (
        {**raw, "seq": "7"}, {**raw, "inside": 1}, {**raw, "extra": 0}, {k: v for k, v in raw.items() if k != "op"},
        {**raw, "seq": -1}, {**raw, "host": "h" * (MAX_TEXT + 1)}, {**raw, "rank": True},
    ):
        assert RankRecord.parse(json.dumps(bad), world_size=2) is None, bad
    assert RankRecord.parse("x" * (MAX_RECORD + 1), world_size=2) is None
    assert RankRecord.parse(b"\xff", world_size=2) is None
    assert RankRecord.parse("[1]", world_size=2) is None
    long_top = RankRecord(**{**raw, "stack_top": "s" * 1000})
    assert len(json.loads(long_top.dumps())["stack_top"]) == MAX_TEXT  # clipped on the way out


def test_the_record_keeps_the_newest_entries_and_what_was_left() -> None:
    now = [0.0]
    kept = CollectiveRecord(clock=lambda: now[0])
    first = kept.enter("train step", 1)
    now[0] = 1.0
    kept.leave(first)
    vote = kept.enter("step vote", 1)
    assert kept.newest().seq == vote and kept.newest().left is None
    assert kept.last_done().describe() == "train step at step 1" and kept.last_done().left == 1.0
    kept.leave(999)  # unknown: ignored
    for step in range(2, KEEP + 10):
        kept.leave(kept.enter("train step", step))
    entries = kept.snapshot()
    assert len(entries) == KEEP and [e.seq for e in entries] == list(range(entries[0].seq, entries[0].seq + KEEP))


class DictStore:
    """The store calls the comparison makes, as torch's stores answer them."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.values[key]

    def check(self, keys: list[str]) -> bool:
        return all(key in self.values for key in keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        if key not in self.values and expected == "":
            self.values[key] = desired.encode()
        return self.values[key]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.values[key] for key in keys]


def namers(world: int, store: DictStore, now: list[float], reports: list[Any],
           environ: dict[str, str] | None = None) -> list[tuple[HangNamer, CollectiveRecord]]:
    made = []
    for rank in range(world):
        kept = CollectiveRecord(clock=lambda: now[0])
        namer = HangNamer(kept, name_after=6.0, gather=6.0, store=lambda: store,
                          place=lambda rank=rank: Place(rank, world, f"node{rank}", "host"),
                          report=reports.append, main_thread=None, environ=environ, clock=lambda: now[0])
        made.append((namer, kept))
    return made


def test_the_ranks_that_talk_name_the_one_blocked_in_python_and_one_reports_it() -> None:
    store, now, reports = DictStore(), [0.0], []
    ranks = namers(3, store, now, reports)
    for namer, kept in ranks:  # all did step 20's vote; ranks 0 and 2 entered step 21, rank 1 never did
        kept.leave(kept.enter("step vote", 20))
    for namer, kept in (ranks[0], ranks[2]):
        kept.enter("train step", 21)
    for tick in range(30):  # every rank's thread looks each 0.5 s; the stall started at 0
        now[0] = tick * 0.5
        for namer, _ in ranks:
            namer.look(now[0], progress=20)
    assert len(reports) == 1, "the first to set the verdict reports it"
    assert reports[0].culprits_ranks() == [1] and reports[0].collective == "train step at step 21"
    assert all(namer.verdicts and namer.verdicts[0].culprits_ranks() == [1] for namer, _ in ranks)
    assert json.loads(json.loads(store.values[f"{PREFIX}rec/1"])["r"])["node"] == "node1"
    assert [namer.is_reader for namer, _ in ranks] == [True, True, False], "rank 0 reads the stall, rank 1 its own"


def test_a_stopped_rank_is_named_from_its_silence_and_an_old_record_does_not_speak_for_it() -> None:
    store, now, reports = DictStore(), [0.0], []
    ranks = namers(2, store, now, reports)
    for namer, kept in ranks:
        kept.enter("train step", 13)
        namer.look(0.0, progress=12)  # both say where they run
    store.set(f"{PREFIX}rec/1", json.dumps({"n": 5, "r": record(1, 1, inside=False).dumps()}))  # a stale record
    began = time.time()
    for tick in range(16, 40):  # rank 1 is stopped: only rank 0 looks, first 8 s into the stall (a late look)
        now[0] = tick * 0.5
        ranks[0][0].look(now[0], progress=12)
    assert [v.culprits_ranks() for v in reports] == [[1]]
    assert reports[0].culprits[0].why == NO_ANSWER and reports[0].culprits[0].node == "node1"
    # When the stall began (not the late look), for the culprit's agent: a worker started after it is a
    # replacement, and a failure of its node since then is this hang's incident
    assert began - 8.0 <= reports[0].since <= time.time() - 8.0 and reports[0].fields()["since"] == reports[0].since


def test_no_verdict_when_training_moves_during_the_comparison_nor_before_the_threshold() -> None:
    store, now, reports = DictStore(), [0.0], []
    (namer, kept), _ = namers(2, store, now, reports)
    kept.enter("train step", 5)
    namer.look(5.9, progress=4)
    assert json.loads(store.values[f"{PREFIX}rec/0"])["n"] == 1  # under the threshold: only where it runs, once
    namer.look(5.95, progress=4)
    assert json.loads(store.values[f"{PREFIX}rec/0"])["n"] == 1 and not any("lead/" in key for key in store.values)
    namer.look(6.0, progress=4)  # the comparison starts
    now[0] = 20.0
    namer.look(0.1, progress=5)  # a step completed: the stall is over
    namer.look(None, progress=5)
    assert reports == [] and namer.verdicts == []


def test_a_store_that_fails_ends_the_comparison_with_a_warning(caplog: Any) -> None:
    class Broken(DictStore):
        def set(self, key: str, value: str) -> None:
            raise RuntimeError("connection reset")

    now, reports = [0.0], []
    namer = HangNamer(CollectiveRecord(), name_after=1.0, gather=1.0, store=Broken, place=lambda: Place(0, 2, "n", "h"),
                      report=reports.append, main_thread=None, clock=lambda: now[0])
    namer.look(2.0, progress=1)
    assert "no culprit is named" in caplog.text and reports == []


def test_naming_comes_well_before_the_watchdog() -> None:
    assert name_after(300) == 60 and 2 * name_after(3) < 3


def test_the_stall_clock_runs_from_the_newest_progress_even_before_the_first_beat_and_not_while_paused() -> None:
    from elastic._worker.control.watchdog import Watchdog

    now = [100.0]
    dog = Watchdog(30, on_trip=lambda message: None, poll=3600, clock=lambda: now[0])
    try:
        assert dog.stalled()[0] is None  # nothing yet
        dog.step_began(9)  # a first step after a restore: the watchdog is not armed, the record is
        now[0] = 104.0
        waited, first = dog.stalled()
        assert waited == 4.0
        dog.beat(9)
        assert dog.record.last_done().describe() == "train step at step 9"
        waited, second = dog.stalled()
        assert waited == 0.0 and second != first
        now[0] = 107.0
        with dog.paused():
            assert dog.stalled()[0] is None
        assert dog.stalled()[0] == 0.0  # the pause restarted the clock
    finally:
        dog.close()


def test_with_the_jobs_secret_a_strangers_record_is_not_heard(tmp_path: Any) -> None:
    secret = tmp_path / "secret"
    secret.write_text("k" * 32)
    store, now, reports = DictStore(), [0.0], []
    (namer, kept), _ = namers(2, store, now, reports, {"TORCHREVIVE_SNAPSHOT_SECRET_FILE": str(secret)})
    kept.enter("train step", 13)
    for tick in range(30):  # rank 1 is silent; a stranger keeps writing a record in its name, behind
        now[0] = tick * 0.5
        store.set(f"{PREFIX}rec/1", json.dumps({"n": tick, "r": record(1, 1, inside=False).dumps()}))
        namer.look(now[0], progress=12)
    assert [v.culprits[0].why for v in reports] == [NO_ANSWER]  # named from its silence, not as "behind"
    assert store.values[f"{PREFIX}rec/0"].count(b"~") >= 1  # this rank's own went in sealed
