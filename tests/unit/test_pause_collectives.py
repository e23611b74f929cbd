"""A peer's death in a collective between steps (elastic._worker.runtime.collectives): inside a pause of a
run that heals in place, `all_reduce_mean` goes on alone and the pause records the break; elsewhere it
raises as torch does. One process: torch.distributed is a stand-in whose all-reduce a dead peer breaks."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic._worker.runtime import collectives
from elastic._worker.runtime.collectives import all_reduce_mean, pause_collectives


class TwoRanks:
    """torch.distributed for rank 0 of 2: the peer's value is 3; `dead` breaks the all-reduce halfway."""

    ReduceOp = dist.ReduceOp

    def __init__(self) -> None:
        self.dead = False
        self.calls = 0

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def get_world_size(self) -> int:
        return 2

    def get_rank(self) -> int:
        return 0

    def all_reduce(self, tensor: torch.Tensor, op: Any = None) -> None:
        self.calls += 1
        tensor += 3.0  # the peer's part arrived ...
        if self.dead:  # ... and the rest never will
            raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242\nmore")


@pytest.fixture
def ranks(monkeypatch: pytest.MonkeyPatch) -> TwoRanks:
    fake = TwoRanks()
    monkeypatch.setattr(collectives, "dist", fake)
    return fake


def test_the_mean_over_the_group_and_a_dead_peer_raises_outside_a_pause(ranks: TwoRanks) -> None:
    assert all_reduce_mean(torch.tensor([1.0])).item() == 2.0
    ranks.dead = True
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        all_reduce_mean(torch.tensor([1.0]))
    with pause_collectives(tolerant=False), pytest.raises(RuntimeError):  # a run that cannot heal
        all_reduce_mean(torch.tensor([1.0]))


def test_in_a_pause_that_heals_a_dead_peer_leaves_this_rank_alone_until_the_next_step(
    ranks: TwoRanks, caplog: pytest.LogCaptureFixture
) -> None:
    value = torch.tensor([1.0, 5.0])
    with pause_collectives(tolerant=True) as pause:
        assert all_reduce_mean(value).tolist() == [2.0, 4.0] and pause.broken is None
        ranks.dead = True
        with caplog.at_level(logging.WARNING):
            alone = all_reduce_mean(value)
        assert alone.tolist() == [1.0, 5.0], "this rank's own value, never the half-reduced tensor"
        assert alone is not value and value.tolist() == [1.0, 5.0]
        assert pause.broken == "[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"
        calls = ranks.calls
        assert all_reduce_mean(value).tolist() == [1.0, 5.0] and ranks.calls == calls, "nothing waits on the broken group"
        voted: list[int] = []
        assert pause.call(lambda: voted.append(1)) is None and voted == [], "the vote between steps is skipped too"
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "rank 0: a collective between steps failed ([gloo/transport/tcp/pair.cc:534] Connection closed by peer "
        "[127.0.0.1]:4242): this rank goes on alone until the next step, which heals the group"]
    with pytest.raises(RuntimeError):  # the pause is over: the next collective is the step's own business
        all_reduce_mean(value)


def test_a_pause_inside_a_pause_restores_the_outer_one_and_alone_no_collective_is_made(ranks: TwoRanks) -> None:
    with pause_collectives(tolerant=True) as outer:
        with pause_collectives(tolerant=False):
            ranks.dead = True
            with pytest.raises(RuntimeError):
                all_reduce_mean(torch.tensor([1.0]))
        assert all_reduce_mean(torch.tensor([1.0])).item() == 1.0 and outer.broken is not None
    assert collectives._current is None
    monkeypatch_alone = SimpleNamespace(is_available=lambda: True, is_initialized=lambda: False)
    collectives.dist = monkeypatch_alone  # (the fixture puts torch's back)
    assert all_reduce_mean(torch.tensor([7.0])).item() == 7.0
