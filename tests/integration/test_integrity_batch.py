"""Issue 44's loop part with ranks as threads (tests/thread_ranks.py): each rank's gradient is a
function of the samples of its block, averaged across the ranks by an all-reduce, as under DDP; the
faults come from ELASTIC_FAULT's own parser. A divergence that follows a sample is named `batch` and
its step skipped (the run ends equal to one that skipped that step), one that stays with a rank is its
`node`; a checkpoint is only ever written of a checked state."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import pytest
import torch
from thread_ranks import run_ranks

from elastic._worker.checkpoint.training_state import TrainingState
from elastic._worker.config import RunConfig
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.integrity.loop_part import Integrity
from elastic._worker.integrity.replica_check import FaultyNodeError, ReplicaDivergence
from elastic._worker.observe.events import EventLog
from elastic._worker.runtime.context import WorkerContext
from elastic.chaos.faults import FaultInjector

SAMPLES, BATCH, SEED = 64, 2, 1


def sample_of(step: int, world: int, block: int) -> int:
    """The first sample of `block` in the global batch of `step` (steps from 1)."""
    sampler = ElasticSampler(SAMPLES, batch_size=BATCH, seed=SEED)
    for _ in range(step - 1):
        sampler.advance(world)
    return int(sampler.global_batch(world)[block * BATCH])


class Loop:
    """One rank's training loop around the Integrity part, as elastic._worker.run.loop drives it."""

    def __init__(self, ctx: WorkerContext, group: Any, fault: str, *, check_every: int, skipped: set[int] = frozenset(),
                 ckpt_every: int = 0, guard: str = "off") -> None:
        self.ctx, self.group, self.ckpt_every = ctx, group, ckpt_every
        self.model = torch.nn.Linear(4, 2)
        with torch.no_grad():
            init = torch.Generator().manual_seed(0)  # the same weights on every rank
            for p in self.model.parameters():
                p.copy_(torch.randn(p.shape, generator=init))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.sampler = ElasticSampler(SAMPLES, batch_size=BATCH, seed=SEED)
        self.events: list[dict[str, Any]] = []
        log = EventLog(None, restart=0)
        log.subscribe(self.events.append)
        self.part = Integrity(ctx, RunConfig(replica_check_every=check_every, numeric_guard=guard), log, group=group)
        self.loss: torch.Tensor | None = None
        extra = self.part.registered(None)
        state = TrainingState(model=self.model, optimizer=self.optimizer, sampler=self.sampler, extra=extra)
        self.part.guard.skipped |= set(skipped)
        self.stack = ExitStack()
        faults = FaultInjector(ctx.rank, 0, {"ELASTIC_FAULT": fault, "WORLD_SIZE": str(ctx.world_size)})
        self.part.attach(state, self.optimizer, faults, self.stack, loss=lambda: self.loss)
        self.trained: list[tuple[int, list[int]]] = []
        self.saved: list[int] = []

    def train(self, steps: int) -> None:
        step = 0
        self.part.loop_started(step, rotatable=True)
        with self.stack:
            while step < steps:
                self.part.step_starting(step)
                mine = self.sampler.local_batch(self.ctx.rank, self.ctx.world_size).tolist()
                self.trained.append((step + 1, mine))
                self.loss = self.model(torch.ones(1, 4)).sum()  # what the guard reads (do=nan spoils it)
                for i, p in enumerate(self.model.parameters()):
                    grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(sum(mine) * 10 + i))
                    self.group.allreduce([grad]).wait()
                    p.grad = grad / self.ctx.world_size
                self.optimizer.step()
                self.sampler.advance(self.ctx.world_size)
                step += 1
                back_to = self.part.step_ended(step, self.ctx, save_due=self.due)
                if back_to is not None:
                    step = back_to
                elif self.due(step):
                    self.saved.append(step)

    def due(self, step: int) -> bool:
        return self.ckpt_every > 0 and step % self.ckpt_every == 0

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def _run(world: int, fault: str, steps: int = 10, **kwargs: Any) -> list[tuple[Loop, str]]:
    def body(ctx: WorkerContext, group: Any) -> tuple[Loop, str]:
        loop = Loop(ctx, group, fault, **kwargs)
        try:
            loop.train(steps)
        except FaultyNodeError as exc:
            from elastic._worker.control import agreement

            agreement.all_ok(ctx, True, group)  # its exit would break its peers' collective; here it completes it
            return loop, f"faulty: {exc}"
        except ReplicaDivergence as exc:
            return loop, f"peer: {exc}"
        return loop, "finished"

    return run_ranks(world, body)


def _corruptions(loop: Loop) -> list[tuple[Any, ...]]:
    return [(e["step"], e["kind"], e["ranks"], e.get("retried_step"), e["action"])
            for e in loop.events if e["event"] == "corruption"]


@pytest.mark.parametrize("world", [3, 2])
def test_a_flip_that_follows_a_sample_names_the_batch_and_skips_its_step(world: int) -> None:
    suspect = sample_of(5, world, block=1)  # rank 1 trains it at step 5, rank 0 once the blocks are rotated
    results = _run(world, f"after_step@5:sample={suspect}:do=flip", check_every=4)
    loop = results[0][0]
    assert [r[1] for r in results] == ["finished"] * world
    # found at 8, replayed from 4 and diverging again at 5, step 5 tried rotated, named, then skipped
    assert _corruptions(loop) == [(8, "batch", [1] if world == 3 else [], 5, "step 5's batch skipped")]
    event = next(e for e in loop.events if e["event"] == "corruption")
    assert event["batch"]["step"] == 5 and event["batch"]["consumed"] == 4 * BATCH * world
    assert suspect in event["batch"]["indices"] and event["batch"]["count"] == BATCH * world
    assert event["batch"]["blocks"] == ([1] if world == 3 else [0, 1])  # two ranks: either half may hold it
    assert all(_corruptions(r[0]) == _corruptions(loop) for r in results)  # every rank reached the same verdict
    steps = [s for s, _ in loop.trained]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8, 5, 5, 5, 6, 7, 8, 9, 10]
    rotated = [b for s, b in results[0][0].trained if s == 5][2]
    assert rotated == next(b for s, b in results[1][0].trained if s == 5)  # the retry: rank 0 trained rank 1's block
    assert all(r[0].part.guard.skipped == {5} for r in results)
    assert all(r[0].sampler.rotation == 0 for r in results)
    # the run ends bit for bit as one that skipped step 5 from the start and saw no fault
    reference = _run(world, "", check_every=4, skipped={5})
    for ours, theirs in zip(results, reference):
        assert all(torch.equal(a, b) for a, b in zip(ours[0].params(), theirs[0].params()))
    assert not _corruptions(reference[0][0])


def test_a_flip_that_stays_with_its_rank_when_the_blocks_move_is_its_node() -> None:
    results = _run(3, "after_step@5:rank=1:restart=any:do=flip", check_every=4)
    assert _corruptions(results[0][0]) == [(8, "node", [1], 5, "node set aside")]
    assert results[1][1].startswith("faulty: rank 1 on ") and "at step 5 again after rolling back to step 4" in results[1][1]
    assert results[0][1].startswith("peer: rank(s) 1 on ")


def test_a_checkpoint_waits_for_a_check_and_the_rollback_point_moves_only_when_one_passes() -> None:
    # checks every 4 steps, checkpoints every 6: the check runs at 6 as well, before the save, so the flip
    # after step 5 is never saved; the flip after step 7 is found at 10 and rolls back to 6 (the last passing check)
    fault = "after_step@5:rank=1:do=flip,after_step@7:rank=2:do=flip"
    results = _run(3, fault, steps=12, check_every=4, ckpt_every=6)
    loop = results[0][0]
    assert [(e["step"], e["kind"], e["ranks"], e["rolled_back_to"]) for e in loop.events if e["event"] == "corruption"] == [
        (6, "transient", [1], 4), (10, "transient", [2], 6)]
    assert loop.saved == [6, 12]  # step 6 saved once, after the replay's check passed
    clean = _run(3, "", steps=12, check_every=4, ckpt_every=6)
    assert all(torch.equal(a, b) for a, b in zip(loop.params(), clean[0][0].params()))


def test_under_rollback_a_nan_that_follows_a_sample_is_the_batch_and_a_one_off_is_transient() -> None:
    suspect = sample_of(5, 2, block=1)
    results = _run(2, f"after_step@5:sample={suspect}:do=nan", check_every=0, guard="rollback")
    numeric = [(e["step"], e["action"], e.get("kind")) for e in results[0][0].events if e["event"] == "numeric"]
    assert numeric == [(5, "rollback", None), (5, "skip", "batch")]  # caught, rolled back to 0, caught again
    assert all(r[0].part.guard.skipped == {5} for r in results)
    skipped = _run(2, "", check_every=0, skipped={5})
    assert all(torch.equal(a, b) for a, b in zip(results[1][0].params(), skipped[1][0].params()))
    once = _run(2, "after_step@5:rank=1:do=nan", check_every=0, guard="rollback")  # first attempt only
    assert [(e["step"], e["action"]) for e in once[0][0].events if e["event"] == "numeric"] == [(5, "rollback")]
    assert all(r[0].part.guard.skipped == set() for r in once)  # transient: replayed and applied
    clean = _run(2, "", check_every=0)
    assert all(torch.equal(a, b) for a, b in zip(once[1][0].params(), clean[1][0].params()))  # bit for bit
