"""Slow ranks named on the step vote, with ranks as threads on real gloo groups (tests/thread_ranks.py):
every rank's own work per step rides on the vote, every rank reaches the same straggler episode at
the same vote step, and the slow rank is named once, with its node and host, then its recovery."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from thread_ranks import run_ranks

from elastic._worker.config import RunConfig
from elastic._worker.control.step_vote import Ballot, StepVote
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.observe.events import EventLog
from elastic._worker.observe.slow_ranks import SlowRanks
from elastic._worker.runtime.context import WorkerContext

pytestmark = pytest.mark.slow

SLOW_RANK, STEPS, RECOVERS_AT = 1, 40, 20


def rank_body(ctx: WorkerContext, group: Any, mode: str = "report") -> dict[str, Any]:
    """A loop of STEPS steps on this rank's own clocks: the step vote's (one second per step, so it votes
    at every step) and the work's (rank 1 takes 2.5 ms a sample until step RECOVERS_AT, the others 1 ms)."""
    work_now, vote_now = [0.0], [0.0]
    seen: list[dict[str, Any]] = []
    events = EventLog(None, restart=0)
    events.subscribe(seen.append)
    sampler = ElasticSampler(10_000, batch_size=8, seed=0)
    slow = SlowRanks(ctx, RunConfig(slow_ranks=mode, slow_factor=1.5, slow_window=3), events, None,
                     sampler=sampler, group=group, clock=lambda: work_now[0])
    vote = StepVote(ctx, Ballot, grace=15.0, clock=lambda: vote_now[0], group=group,
                    slots=slow.figures)
    lengths, trained, changed_at = set(), 0, []
    for step in range(1, STEPS + 1):
        slow.step_started()
        share = len(sampler.local_batch(ctx.rank, ctx.world_size))
        trained += share
        work_now[0] += share * (0.0025 if ctx.rank == SLOW_RANK and step < RECOVERS_AT else 0.001)
        sampler.advance(ctx.world_size)
        slow.step_ended()
        vote_now[0] += 1.0
        verdict = vote.step_ended(step)
        lengths.add(len(verdict.slots))
        if slow.verdict(verdict.slots, step):
            changed_at.append((step, sampler.shares))
    vote.settle()
    return {"seen": seen, "lengths": lengths, "every": vote.every, "trained": trained, "changed_at": changed_at,
            "consumed": sampler.state_dict()}


def test_every_rank_names_the_slow_rank_once_at_the_same_step_and_its_recovery() -> None:
    results = run_ranks(3, rank_body)
    first = [(r["event"], r["step"], r["rank"], r["slowdown"]) for r in results[0]["seen"]]
    for result in results:
        assert [(r["event"], r["step"], r["rank"], r["slowdown"]) for r in result["seen"]] == first
        assert result["lengths"] <= {0, 3} and 3 in result["lengths"]  # the first vote step reads no vote
        assert result["every"] == 1
    assert [(kind, rank) for kind, _, rank, _ in first] == [("straggler", SLOW_RANK), ("straggler_recovered", SLOW_RANK)]
    assert all(r["changed_at"] == [] and r["trained"] == 8 * STEPS for r in results)  # report: even shares
    started, recovered = results[0]["seen"]
    assert started["slowdown"] == 2.5 and started["step"] <= 1 + 3 + 1  # a full window, read one vote late
    assert started["host"] == socket.gethostname() and started["node"]
    assert RECOVERS_AT < recovered["step"] <= RECOVERS_AT + 3 + 1 and recovered["slowdown"] == 1.0


def test_off_carries_no_figures_and_names_nobody() -> None:
    def body(ctx: WorkerContext, group: Any) -> tuple[int, list[dict[str, Any]]]:
        seen: list[dict[str, Any]] = []
        events = EventLog(None, restart=0)
        events.subscribe(seen.append)
        slow = SlowRanks(ctx, RunConfig(slow_ranks="off"), events, None, group=group)
        vote = StepVote(ctx, Ballot, grace=15.0, group=group, slots=slow.figures)
        widths = set()
        for step in range(1, 6):
            slow.step_started()
            slow.step_ended()
            verdict = vote.step_ended(step)
            widths.add(len(verdict.slots))
            slow.verdict(verdict.slots, step)
        vote.settle()
        return len(widths - {0}), seen

    for extra, seen in run_ranks(2, body):
        assert extra == 0 and seen == []


def test_rebalancing_ranks_take_the_same_shares_at_the_same_step_and_the_slow_one_trains_fewer() -> None:
    results = run_ranks(3, lambda ctx, group: rank_body(ctx, group, "rebalance"))
    changes = results[0]["changed_at"]
    assert [r["changed_at"] for r in results] == [changes] * 3 and [r["consumed"] for r in results] == [
        results[0]["consumed"]] * 3
    assert len(changes) == 2, changes  # one cut for the slow rank, one back after it recovered
    (cut_at, cut), (back_at, back) = changes
    assert cut == (10, 4, 10) and cut_at <= 1 + 3 + 1  # 2.5 times slower: 4 of 24 samples, not 8
    assert RECOVERS_AT < back_at and back == (8, 8, 8)
    assert sum(r["trained"] for r in results) == 24 * STEPS  # the global batch never changed
    assert results[SLOW_RANK]["trained"] < 8 * STEPS < results[0]["trained"]
    rebalanced = [e["shares"] for e in results[0]["seen"] if e["event"] == "rebalance"]
    assert rebalanced == [[10, 4, 10], [8, 8, 8]]


def weighted_ddp_rank(ctx: WorkerContext, group: Any, *, hooked_before: bool) -> dict[str, Any]:
    """One rank of two: a float64 DDP over `group` trains its share of a global batch of 16 split 5/11
    (batch size 8), its gradient weighted as --slow-ranks rebalance does; `hooked_before`: the DDP has a
    communication hook already (as the survivors' is), so the weights fall back to parameter hooks."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from elastic._worker.observe.rebalance import GradientWeights

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1)).double()
    reference = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1)).double()
    wrapped = dist.ProcessGroup(group._get_backend_name() and dist.HashStore(), ctx.rank, ctx.world_size)  # DDP takes
    wrapped._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, group)  # a ProcessGroup
    wrapped._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group = wrapped
    ddp = DistributedDataParallel(model, process_group=group)  # rank 0's weights on every rank
    reference.load_state_dict(model.state_dict())  # (the threads share torch's seed: draws interleave)
    if hooked_before:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        ddp.register_comm_hook(group, allreduce_hook)
    weights = GradientWeights(model, ddp)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 5, generator=generator, dtype=torch.float64), torch.randn(16, 1, generator=generator,
                                                                                     dtype=torch.float64)
    shares = (5, 11)
    start = sum(shares[: ctx.rank])
    weights.scale = shares[ctx.rank] / 8
    part = slice(start, start + shares[ctx.rank])
    torch.nn.functional.mse_loss(ddp(x[part]), y[part]).backward()  # this rank's mean loss over its share
    torch.nn.functional.mse_loss(reference(x), y).backward()  # the global batch's mean loss, on one model
    gaps = [float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(), reference.parameters())]
    weights.close()
    return {"in_all_reduce": weights.in_all_reduce, "gap": max(gaps)}


@pytest.mark.parametrize("hooked_before", [False, True])
def test_uneven_shares_weighted_in_ddps_all_reduce_or_by_parameter_hooks_give_the_global_mean_gradient(
    hooked_before: bool,
) -> None:
    results = run_ranks(2, lambda ctx, group: weighted_ddp_rank(ctx, group, hooked_before=hooked_before))
    assert [r["in_all_reduce"] for r in results] == [not hooked_before] * 2
    assert max(r["gap"] for r in results) < 1e-12, results


def even_share_rank(ctx: WorkerContext, group: Any) -> bool:
    """At the even share the weighting hook in DDP's all-reduce gives DDP's own gradients, bit for bit."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from elastic._worker.observe.rebalance import GradientWeights

    wrapped = dist.ProcessGroup(dist.HashStore(), ctx.rank, ctx.world_size)
    wrapped._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, group)
    wrapped._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    models = [torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)) for _ in range(2)]
    plain, hooked = (DistributedDataParallel(m, process_group=wrapped) for m in models)
    models[1].load_state_dict(models[0].state_dict())
    weights = GradientWeights(models[1], hooked)
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(ctx.rank))
    for ddp in (plain, hooked):
        ddp(x).square().mean().backward()
    return weights.in_all_reduce and all(torch.equal(p.grad, q.grad) for p, q in zip(*(m.parameters() for m in models)))


def test_at_the_even_share_the_all_reduce_hook_leaves_ddps_gradients_bit_for_bit() -> None:
    assert run_ranks(3, even_share_rank) == [True, True, True]
