"""Replica checks and the numeric guard where ranks must agree, with ranks as threads (tests/thread_ranks.py):
each rank trains the same small model on the same gradients, so the replicas stay bit-identical unless
a test flips a bit; the checks' exchange and the guard's agreement run on each thread's gloo group."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from thread_ranks import run_ranks

from elastic._worker.checkpoint.training_state import TrainingState
from elastic._worker.control import agreement
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.integrity import tamper
from elastic._worker.integrity.numeric_guard import NumericGuard
from elastic._worker.integrity.replica_check import (
    FaultyNodeError,
    ReplicaCheck,
    ReplicaDivergence,
)
from elastic._worker.integrity.rollback import RollbackPoint
from elastic._worker.observe.events import EventLog
from elastic._worker.runtime.context import WorkerContext


class Trainer:
    """One rank: a model, an optimizer, a sampler, a replica check every 2 steps."""

    def __init__(self, ctx: WorkerContext, group: Any) -> None:
        self.model = torch.nn.Linear(4, 2)
        init = torch.Generator().manual_seed(0)  # the same weights on every rank (threads share torch's default one)
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(torch.randn(p.shape, generator=init))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        state = TrainingState(model=self.model, optimizer=self.optimizer, sampler=ElasticSampler(64, batch_size=2, seed=1))
        self.events: list[dict[str, Any]] = []
        log = EventLog(None, restart=0)
        log.subscribe(self.events.append)
        self.check = ReplicaCheck(ctx, RollbackPoint(state, ctx.device), self.model, 2, events=log, group=group,
                                  node=f"node-{ctx.rank}")
        self.step = 0
        self.trained: list[int] = []

    def train_step(self) -> None:
        self.step += 1
        self.trained.append(self.step)
        g = torch.Generator().manual_seed(self.step)  # the same gradients on every rank: an all-reduce's result
        for p in self.model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        self.optimizer.step()

    def run(self, steps: int, flip: Any = lambda step: False) -> None:
        self.check.start(0)
        while self.step < steps:
            self.train_step()
            if flip(self.step):
                tamper.flip_one_bit(self.model)
            back_to = self.check.after_step(self.step)
            if back_to is not None:
                self.step = back_to


def test_three_ranks_name_a_transient_flip_and_a_rank_that_flips_every_time() -> None:
    def body(ctx: WorkerContext, group: Any) -> tuple[list[dict[str, Any]], list[int], str]:
        trainer = Trainer(ctx, group)
        flipped: set[int] = set()

        def flip(step: int) -> bool:  # rank 1 once after step 3; rank 2 after step 7 at every attempt
            if ctx.rank == 1 and step == 3 and step not in flipped:
                flipped.add(step)
                return True
            return ctx.rank == 2 and step == 7

        try:
            trainer.run(10, flip)
        except FaultyNodeError as exc:
            agreement.all_ok(ctx, True, group)  # its exit would break its peers' collective; here it completes it
            return trainer.events, trainer.trained, f"faulty: {exc}"
        except ReplicaDivergence as exc:
            return trainer.events, trainer.trained, f"peer: {exc}"
        return trainer.events, trainer.trained, "finished"

    results = run_ranks(3, body)
    events = results[0][0]
    assert [(e["step"], e["kind"], e["ranks"], e["nodes"], e["rolled_back_to"], e["steps_replayed"]) for e in events] == [
        (4, "transient", [1], ["node-1"], 2, 2), (8, "node", [2], ["node-2"], 6, 2)]
    def verdicts(of: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
        return [(e["step"], e["kind"], e["ranks"], e["action"], e["rolled_back_to"]) for e in of]

    assert all(verdicts(r[0]) == verdicts(events) for r in results)  # every rank reached the same verdicts
    # each mismatch replayed from the last passing check, checked at every replayed step; the step the
    # replay diverged at (7) trained a third time from the step before it (no sampler here: not rotated)
    assert results[0][1] == [1, 2, 3, 4, 3, 4, 5, 6, 7, 8, 7, 7]
    assert results[2][2].startswith("faulty: rank 2 on node-2 diverged from its replicas at step 7 again")
    assert results[0][2] == results[1][2] == (
        "peer: rank(s) 2 on node-2 diverged again at step 7 after rolling back to step 6 and leave the job")


def test_two_ranks_that_each_repeat_their_result_stop_in_one_line() -> None:
    def body(ctx: WorkerContext, group: Any) -> str:
        trainer = Trainer(ctx, group)
        with pytest.raises(ReplicaDivergence) as caught:
            trainer.run(6, lambda step: ctx.rank == 1 and step == 3)
        assert [e["kind"] for e in trainer.events] == ["node"] and trainer.events[0]["ranks"] == []
        return str(caught.value)

    line = ("the replicas differ at step 3 again after rolling back to step 2, and each rank repeated its own "
            "result: nothing tells the faulty one (two ranks); stopping")
    assert set(run_ranks(2, body)) == {line}


def test_one_ranks_nan_loss_makes_every_rank_skip_the_step() -> None:
    def body(ctx: WorkerContext, group: Any) -> tuple[str | None, str | None, list[dict[str, Any]]]:
        guard = NumericGuard("skip", spike=0.0, agree=lambda bad: agreement.any_set(ctx, bad, group=group)[0])
        param = torch.nn.Parameter(torch.ones(2))
        param.grad = torch.ones(2)
        good = guard.before_update(1, [param], torch.tensor(1.0))
        param.grad = torch.ones(2)  # finite gradients everywhere; only rank 0's loss is NaN
        bad = guard.before_update(2, [param], torch.tensor(math.nan if ctx.rank == 0 else 1.0))
        assert param.grad is None
        return good, bad, guard.caught

    results = run_ranks(2, body)
    assert [r[:2] for r in results] == [(None, "skip"), (None, "skip")]
    assert results[0][2][0]["why"] == "non-finite loss" and results[1][2][0]["why"] == "a peer's reading"
