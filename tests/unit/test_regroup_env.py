"""Where a worker's heals meet (elastic._worker.survivors.regroup.heal_point) is read from torchrevive-run's variables;
a malformed one is one line naming it; and `agree`'s ballots (elastic._worker.survivors.catch_up) pick the most
steps and, among the members that completed them, the lowest rank."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from elastic._shared.common.errors import EnvironmentConfigError
from elastic._shared.protocol import heal_env
from elastic._worker.survivors import catch_up, regroup


def env(store: str, namespace: str = "run/10.0.0.1:29500", generation: str = "0") -> dict[str, str]:
    return {heal_env.HEAL_STORE_ENV: store, heal_env.HEAL_NAMESPACE_ENV: namespace,
            heal_env.HEAL_GENERATION_ENV: generation}


def test_no_heal_point_without_torchrevive_runs_variable() -> None:
    assert regroup.heal_point({}) is None


@pytest.mark.parametrize(
    ("variables", "named"),
    [
        (env("localhost"), heal_env.HEAL_STORE_ENV),
        (env("host:port"), heal_env.HEAL_STORE_ENV),
        (env("host:0"), heal_env.HEAL_STORE_ENV),
        (env("host:70000"), heal_env.HEAL_STORE_ENV),
        (env(":29500"), heal_env.HEAL_STORE_ENV),
        (env("host:29500", namespace=""), heal_env.HEAL_NAMESPACE_ENV),
        (env("host:29500", generation="-1"), heal_env.HEAL_GENERATION_ENV),
        (env("host:29500", generation="one"), heal_env.HEAL_GENERATION_ENV),
    ],
)
def test_a_malformed_variable_is_one_line_naming_it(variables: dict[str, str], named: str) -> None:
    with pytest.raises(EnvironmentConfigError, match=named) as raised:
        regroup.heal_point(variables)
    assert "\n" not in str(raised.value)


@given(st.text(max_size=40))
@example("0:\u00b2")  # "²".isdigit() is true and int("²") fails: the oracle itself once raised ValueError
def test_any_store_address_is_a_heal_point_or_one_line(address: str) -> None:
    if not address:
        return
    host, _, port = address.rpartition(":")
    if host and port.isascii() and port.isdigit() and 0 < int(port) < 65536:
        return  # well formed: it would connect
    with pytest.raises(EnvironmentConfigError):
        regroup.heal_point(env(address))


@pytest.mark.parametrize(
    ("completed", "agreed"),
    [
        ([9, 10, 10, 0], catch_up.Agreement(fewest=0, most=10, source=1)),  # two ahead, a replacement
        ([5, 5], catch_up.Agreement(fewest=5, most=5, source=0)),
        ([0, 0, 7], catch_up.Agreement(fewest=0, most=7, source=2)),
    ],
)
def test_the_ballots_name_the_most_steps_and_the_lowest_rank_that_completed_them(completed, agreed) -> None:
    world = len(completed)
    votes = torch.stack([catch_up.ballot(c, rank=r, world_size=world) for r, c in enumerate(completed)])
    assert catch_up.count(votes.max(dim=0).values, world_size=world) == agreed


@given(st.lists(st.integers(min_value=0, max_value=10**9), min_size=1, max_size=64))
def test_any_ballots_count_right(completed: list[int]) -> None:
    world = len(completed)
    votes = torch.stack([catch_up.ballot(c, rank=r, world_size=world) for r, c in enumerate(completed)])
    agreed = catch_up.count(votes.max(dim=0).values, world_size=world)
    assert (agreed.fewest, agreed.most) == (min(completed), max(completed))
    assert agreed.source == completed.index(max(completed))
