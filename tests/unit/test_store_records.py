"""Records the survivors keep in the rendezvous store (elastic._shared.storage.store_records), sealed
with the job's secret: what a stranger who can reach the store writes is ignored with one warning, and
no count read from the store drives a loop (issue 40, item 6). In-process stores only."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch.distributed as dist

from elastic._agent.launcher.in_place import raise_generation
from elastic._shared.protocol import heal_env
from elastic._shared.storage.peer_auth import PeerKey
from elastic._shared.storage.store_records import Records, strict_count
from elastic._worker.survivors import joiners, views
from elastic._worker.survivors.views import View

KEY = PeerKey(b"k" * 32)


class Counted:
    """A store that counts the calls made on it (what a loop over a forged count would cost)."""

    def __init__(self) -> None:
        self.inner, self.calls = dist.HashStore(), 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)

        def counted(*args: Any) -> Any:
            self.calls += 1
            return method(*args)

        return counted


def sealed(store: Any = None, world: int = 4) -> Records:
    return Records(store if store is not None else dist.HashStore(), key=KEY, scope="run/0/h:1", world=world)


def test_a_forged_view_is_ignored_with_one_warning_and_a_stranger_never_joins(caplog: pytest.LogCaptureFixture) -> None:
    records = sealed()
    records.store.set("view/1/members", "0|grow|0.0,1.0,3.7")  # a stranger's view, with itself in it
    with caplog.at_level(logging.WARNING):
        assert views.read_view(records, 1) is None
        assert views.read_view(records, 1) is None
    assert len([r for r in caplog.records if "view/1/members" in r.getMessage()]) == 1
    with pytest.raises(views.ViewError, match="not this job's"):  # its slot is taken: a new round, one line
        joiners.admit(records, View(0, ("0.0", "1.0")), upto=0)


def test_a_view_sealed_for_another_round_or_key_is_not_one() -> None:
    other_round = Records(dist.HashStore(), key=KEY, scope="run/1/h:1", world=4)
    records = sealed()
    records.store.set("view/1/members", other_round.seal("view/1/members", "0|grow|0.0,1.0"))
    records.store.set("view/2/members", records.seal("view/3/members", "0|grow|0.0,1.0"))
    assert views.read_view(records, 1) is None and views.read_view(records, 2) is None
    views.close_view(records, 3, ["0.0", "1.0"], considered=0)
    assert views.read_view(records, 3) == View(3, ("0.0", "1.0"))


def test_a_forged_ticket_and_a_forged_failure_mark_are_ignored() -> None:
    records = sealed()
    joiners.register_joiner(records, "2.1")
    records.store.add(heal_env.JOINERS_KEY, 1)
    records.store.set("joiner/2", "3.9")  # a stranger's ticket
    records.store.set(heal_env.failed_key("1.0"), "1")  # and a stranger's claim that rank 1 died
    assert not views.failed(records, "1.0")
    grown = joiners.admit(records, View(0, ("0.0", "1.0")), upto=2)
    assert grown.members == ("0.0", "1.0", "2.1") and grown.considered == 2


def test_a_forged_joiner_count_costs_rank_0_at_most_a_world_of_tickets() -> None:
    store = Counted()
    records = sealed(store, world=4)
    store.inner.add(heal_env.JOINERS_KEY, 10**6)  # a stranger's count
    grown = joiners.admit(records, View(0, ("0.0", "1.0")), upto=joiners.joiners_waiting(records))
    assert grown.considered == 4 and store.calls < 40


def test_a_forged_arrivals_count_costs_a_poll_nothing() -> None:
    store = Counted()
    records = sealed(store, world=2)
    store.inner.add("view/1/arrivals", 10**6)  # the count earlier versions looped over
    views.arrive(records, views.first_view(2), "1.0")
    store.calls = 0
    view = views.after_failure(records, views.first_view(2), "0.0", sleep=lambda s: None)
    assert view.members == ("0.0", "1.0") and store.calls < 40


def test_a_member_note_that_is_not_a_count_is_taken_as_the_agents_generation() -> None:
    records = sealed(Records(dist.HashStore()).store)
    records.store.set(heal_env.member_key(1), "²")  # int("²") raised in the agent after it stopped its workers
    records.set(heal_env.member_key(2), "²")  # sealed, still no count
    assert raise_generation(records, [1, 2], started_in=0) == 1
    records.store.set(heal_env.GENERATION_KEY, "²")
    assert raise_generation(records, [1], started_in=0) == 0, "no heal: the agent takes a new round"


@pytest.mark.parametrize("text", ["²", "١", "1_0", " 1", "-1", "", "9" * 20, "5"])
def test_counts_are_ascii_digits_within_their_bound(text: str) -> None:
    assert strict_count(text, most=4) is None
    assert strict_count("4", most=4) == 4


def test_without_a_secret_records_are_validated_only() -> None:
    bare = Records(dist.HashStore(), world=2)
    bare.store.set("view/1/members", "0|shrink|0.0,5.0")  # rank 5 of a round of 2
    assert views.read_view(bare, 1) is None
    bare.set("view/2/members", "0|shrink|0.0")
    assert views.read_view(bare, 2) == View(2, ("0.0",))
