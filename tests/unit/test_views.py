"""Who trains together when the survivors train on (elastic._worker.survivors.views), on an in-process store: a view closes
once and every worker reads the same list; after a failure it closes as soon as the dead are marked, or
after the settle time without them; a late survivor and a passed-over joiner are taken in later; a
malformed record in the store is one `ViewError` line (hypothesis); and the pieces around them: the
setting's values, worker ids, the step vote's joiners field, the loader's restart at a new size, the
event log's new writer and the agents' exit barrier."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic._agent.launcher import exit_barrier
from elastic._shared.protocol import heal_env
from elastic._shared.storage.store_records import Records
from elastic._worker.data.feed import Feed, StepBatchSampler
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.observe.events import EventLog, read_events
from elastic._worker.survivors import joiners, views
from elastic._worker.survivors.views import View, ViewError


class Clock:
    """A clock the waits advance: every sleep moves it on, nothing really sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def records(world: int = 8) -> Records:
    """An in-process store's records, unsealed (test_store_records.py seals them)."""
    return Records(dist.HashStore(), world=world)


def ids(*ranks: int, incarnation: int = 0) -> tuple[str, ...]:
    return tuple(heal_env.member_id(rank, incarnation) for rank in ranks)


def test_the_first_view_is_every_rank_of_the_round() -> None:
    first = views.first_view(3)
    assert (first.number, first.members, first.world_size) == (0, ids(0, 1, 2), 3)
    assert first.rank_of("2.0") == 2 and first.rank_of("2.1") is None


def test_survivors_close_the_next_view_once_the_dead_are_marked() -> None:
    store, clock = records(), Clock()
    first = views.first_view(3)
    store.set(heal_env.failed_key("1.0"), "1")  # rank 1's agent said it died
    views.arrive(store, first, "2.0")  # rank 2 arrived already
    view = views.after_failure(store, first, "0.0", clock=clock, sleep=clock.sleep)
    assert (view.number, view.members, view.grown) == (1, ids(0, 2), False)
    assert clock.now == 0.0, "nobody left to wait for: closed at once"
    assert views.latest(store) == 1
    assert views.after_failure(store, first, "2.0", clock=clock, sleep=clock.sleep) == view, "one list for all"


def test_a_worker_marked_failed_after_it_arrived_is_left_out_and_told_to_leave() -> None:
    store, clock = records(), Clock()
    first = views.first_view(3)
    views.arrive(store, first, "1.0")  # rank 2's node-mate: its agent stops it after rank 2 died
    store.set(heal_env.failed_key("1.0"), "1")
    store.set(heal_env.failed_key("2.0"), "1")
    view = views.after_failure(store, first, "0.0", clock=clock, sleep=clock.sleep)
    assert view.members == ids(0) and views.failed(store, "1.0")


def test_a_member_neither_arrived_nor_marked_is_waited_for_the_settle_time_then_left_out() -> None:
    store, clock = records(), Clock()
    view = views.after_failure(store, views.first_view(2), "0.0", settle=1.0, clock=clock, sleep=clock.sleep)
    assert view.members == ids(0) and 1.0 <= clock.now < 1.1  # a lost node: its agent never marks it
    late = views.after_failure(store, views.first_view(2), "1.0", clock=clock, sleep=clock.sleep)
    assert late == view and late.rank_of("1.0") is None, "a survivor that came late is not in it: it joins later"


def test_a_grow_admits_the_waiting_joiners_in_rank_order_and_skips_the_dead_and_the_taken() -> None:
    store = records()
    current = View(4, ids(0, 2), considered=0)
    assert joiners.joiners_waiting(store) == 0
    joiners.register_joiner(store, "3.1")
    joiners.register_joiner(store, "1.2")
    joiners.register_joiner(store, "2.5")  # rank 2 is a member already: not admitted twice
    joiners.register_joiner(store, "4.1")
    store.set(heal_env.failed_key("4.1"), "1")  # died while it waited
    assert joiners.joiners_waiting(store) == 4
    grown = joiners.admit(store, current, upto=4)
    assert (grown.number, grown.members, grown.considered, grown.grown) == (5, ("0.0", "1.2", "2.0", "3.1"), 4, True)
    assert grown.rank_of("3.1") == 3 and joiners.wait_view(store, 5, timeout=0) == grown


def test_a_joiner_passed_over_by_a_view_takes_a_new_ticket_and_is_admitted_by_the_next() -> None:
    store, clock = records(), Clock()
    first = views.first_view(2)
    ticket = joiners.register_joiner(store, "1.1")
    views.close_view(store, 1, ["0.0"], considered=ticket)  # a view that considered it without it
    grown = View(2, ("0.0", "1.1"), considered=2, grown=True)
    calls = itertools.count()

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        if next(calls) == 0:  # rank 0 admits the new ticket while the joiner waits
            assert joiners.joiners_waiting(store) == 2
            views.close_view(store, 2, list(grown.members), considered=2, grown=True)

    assert joiners.wait_for_admission(store, "1.1", after=0, ticket=ticket, first=first, stale_after=60,
                                      clock=clock, sleep=sleep) == grown


def test_a_joiner_leaves_when_the_job_ended_and_when_nobody_is_left_to_take_it_in() -> None:
    store, clock = records(), Clock()
    first = views.first_view(2)
    ticket = joiners.register_joiner(store, "1.1")
    joiners.mark_ended(store)
    assert joiners.wait_for_admission(store, "1.1", after=0, ticket=ticket, first=first, stale_after=60,
                                      clock=clock, sleep=clock.sleep) is None
    orphaned = records()
    for member in first.members:
        orphaned.set(heal_env.failed_key(member), "1")
    came = clock.now
    with pytest.raises(ViewError, match="every worker of view 0 failed"):
        joiners.wait_for_admission(orphaned, "1.1", after=0, ticket=1, first=first, stale_after=60, clock=clock,
                                   sleep=clock.sleep)
    # At once, not a settle time later: in the soak, a train-on joiner whose view's members were killed
    # together with its own worker waited 2.2 s before the round, a stall of 3.4 s.
    assert clock.now == came
    with pytest.raises(ViewError, match="no step vote for 30 s"):  # a lost node's workers are never marked
        joiners.wait_for_admission(records(), "1.1", after=0, ticket=1, first=first, stale_after=30,
                                   clock=clock, sleep=clock.sleep)


def test_a_joiner_waits_as_long_as_the_group_votes() -> None:
    store, clock = records(), Clock()
    ticket = joiners.register_joiner(store, "1.1")
    calls = itertools.count()

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        joiners.joiners_waiting(store)  # rank 0's vote: the group trains on
        if next(calls) == 3000:  # a minute of votes later, it is admitted
            views.close_view(store, 1, ["0.0", "1.1"], considered=ticket)

    view = joiners.wait_for_admission(store, "1.1", after=0, ticket=ticket, first=views.first_view(2),
                                      stale_after=30, clock=clock, sleep=sleep)
    assert view is not None and view.members == ("0.0", "1.1") and clock.now > 30


def test_a_ticket_left_unwritten_is_voided_and_never_blocks_the_joiners_after_it() -> None:
    store = records()
    store.store.add(heal_env.JOINERS_KEY, 1)  # a joiner took ticket 1 and died before writing it
    assert joiners.register_joiner(store, "3.1") == 2
    grown = joiners.admit(store, View(0, ids(0, 1)), upto=2)
    assert grown.members == ("0.0", "1.0", "3.1") and grown.considered == 2
    assert joiners.register_joiner(store, "2.1") == 3, "ticket 1 stays void"


def test_a_view_forms_when_all_its_members_came_and_every_member_learns_the_same_outcome() -> None:
    store, clock = records(), Clock()
    view = View(3, ids(0, 1))
    assert not views.gather(store, view, "0.0", timeout=0.5, clock=clock, sleep=clock.sleep), "rank 1 never came"
    assert not views.gather(store, view, "1.0", timeout=0.5, clock=clock, sleep=clock.sleep), "it came after the give-up"
    store = records()
    store.set("view/3/present/1.0", "1")  # rank 1 is there; it sees rank 0 there too and says "formed" ...
    assert views.gather(store, view, "0.0", timeout=0.5, clock=clock, sleep=clock.sleep)
    store.store.delete_key("view/3/present/1.0")  # ... and a member whose wait ran out after that still forms it
    assert views.gather(store, view, "0.0", timeout=0, clock=clock, sleep=clock.sleep)


def test_a_view_whose_missing_member_was_marked_failed_is_given_up_at_once() -> None:
    """A train-on joiner killed between its admission (the grow) and its arrival: the survivor waited out
    GATHER_SECONDS (10 s, measured by the soak) for a worker its agent had already marked failed."""
    store, clock = records(), Clock()
    grown = View(4, ids(0) + ids(1, incarnation=2))
    store.set(heal_env.failed_key("1.2"), "1")
    assert not views.gather(store, grown, "0.0", timeout=10.0, clock=clock, sleep=clock.sleep)
    assert clock.now == 0.0 and store.get("view/4/outcome") == "given up"
    # the first member died instead: a survivor that is not first sees its mark, not only the timeout
    store, clock = records(), Clock()
    store.set(heal_env.failed_key("0.2"), "1")
    assert not views.gather(store, View(5, ids(0, incarnation=2) + ids(1)), "1.0", timeout=10.0, clock=clock,
                            sleep=clock.sleep)
    assert clock.now == 0.0


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.text(max_size=60))
def test_a_view_record_from_the_store_is_a_view_or_one_line(text: str) -> None:
    try:
        view = View.parse(7, text)
    except ViewError as error:
        assert "\n" not in str(error)
        return
    ranks = [heal_env.parse_member_id(member)[0] for member in view.members]
    assert ranks == sorted(set(ranks)) and view.world_size >= 1 and view.considered >= 0
    assert View.parse(7, view.encode()) == view


@pytest.mark.parametrize("text", ["", "0|shrink|", "x|shrink|0.0", "0|shrink|0.0,0.1", "0|grow|1.0,0.0",
                                  "0|shrink|0.0,,1.0", "-1|shrink|0.0", "0|shrink|٣.0", "0|0.0", "0|later|0.0"])
def test_malformed_view_records_are_refused(text: str) -> None:
    with pytest.raises(ViewError):
        View.parse(1, text)


@given(st.text(max_size=30))
def test_a_worker_id_parses_or_is_refused(text: str) -> None:
    try:
        rank, incarnation = heal_env.parse_member_id(text)
    except ValueError:
        return
    assert heal_env.parse_member_id(heal_env.member_id(rank, incarnation)) == (rank, incarnation)


@pytest.mark.parametrize(("value", "mode"), [("", "restart"), ("restart", "restart"), ("keep", "keep"),
                                             ("train-on", "train-on")])
def test_the_setting_takes_its_three_values(value: str, mode: str) -> None:
    assert heal_env.mode({heal_env.SURVIVORS_ENV: value}) == mode


def test_another_value_of_the_setting_names_the_choices() -> None:
    with pytest.raises(ValueError, match="restart, keep, train-on"):
        heal_env.mode({heal_env.SURVIVORS_ENV: "shrink"})


def test_the_loader_starts_again_with_the_new_rank_and_world_size() -> None:
    sampler = ElasticSampler(100, batch_size=4, seed=0)
    loader = torch.utils.data.DataLoader(list(range(100)), batch_sampler=StepBatchSampler(sampler, 1, 3))
    feed = Feed(loader, 4)
    expected = sampler.local_batch(1, 3)
    assert feed.fetch(expected, step=0, until="max_steps=10").tolist() == expected.tolist()
    feed.check(expected, step=0, rank=1)
    sampler.advance(3)
    feed.reopen(0, 2)  # the group shrank: this worker is rank 0 of 2 now
    expected = sampler.local_batch(0, 2)
    assert feed.fetch(expected, step=1, until="max_steps=10").tolist() == expected.tolist()
    feed.check(expected, step=1, rank=0)
    assert Feed(None, 4).resizable and not Feed(torch.utils.data.DataLoader(list(range(8))), 4).resizable


def test_the_event_log_changes_writer_when_a_worker_becomes_rank_0(tmp_path: Any) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(None, restart=0)
    log.emit("start", step=0, world_size=3)  # not rank 0 yet: nothing written
    log.write_to(path)
    log.emit("heal", step=6, world_size=2)
    log.write_to(None)
    log.emit("step", step=7, world_size=2)
    log.close()
    assert [e["event"] for e in read_events(path)] == ["heal"]


class FakeHolder:
    def __init__(self, live: list[int]) -> None:
        self.live, self._last_sync_time = live, 0.0
        self.state = type("State", (), {"participants": {}})()

    def sync(self) -> None:
        self.state.participants = dict.fromkeys(range(self.live.pop(0) if len(self.live) > 1 else self.live[0]))


def test_the_exit_barrier_waits_for_the_live_nodes_only() -> None:
    store, clock = dist.HashStore(), Clock()
    handler = type("Handler", (), {})()
    handler._state_holder = FakeHolder([3, 3, 2])  # a node the keep-alive stops counting two polls later
    store.add("torchrevive/exit-barrier", 1)  # another agent got there first
    assert exit_barrier.wait_for_live_nodes(store, handler, timeout=60, clock=clock, sleep=clock.sleep)
    handler._state_holder = FakeHolder([3])
    assert not exit_barrier.wait_for_live_nodes(dist.HashStore(), handler, timeout=0.2, clock=clock, sleep=clock.sleep)
