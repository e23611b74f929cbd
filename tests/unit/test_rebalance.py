"""`--slow-ranks rebalance` in one process (elastic._worker.observe.rebalance): the shares follow the
figures, and a gradient weighted by its share averages to the even split's."""

from __future__ import annotations

import random

import torch

from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.observe.rebalance import GradientWeights, Rebalancer


def model_copies(count: int) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))
    copies = []
    for _ in range(count):
        copy = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))
        copy.load_state_dict(base.state_dict())
        copies.append(copy)
    return copies


def test_weighted_gradients_averaged_as_ddp_does_are_the_global_batch_mean_gradient() -> None:
    torch.manual_seed(1)
    x, y = torch.randn(12, 5, dtype=torch.float64), torch.randn(12, 1, dtype=torch.float64)
    batch_size, shares = 4, (2, 7, 3)  # three ranks, a global batch of 12 split unevenly
    reference, *ranks = [m.double() for m in model_copies(4)]
    torch.nn.functional.mse_loss(reference(x), y).backward()  # a loss that is a mean over the batch
    start, weights = 0, []
    for model, share in zip(ranks, shares):
        weighted = GradientWeights(model)
        weighted.scale = share / batch_size
        part = slice(start, start + share)
        torch.nn.functional.mse_loss(model(x[part]), y[part]).backward()
        weights.append(weighted)
        start += share
    for name, expected in reference.named_parameters():
        averaged = sum(dict(m.named_parameters())[name].grad for m in ranks) / len(ranks)  # DDP's mean
        torch.testing.assert_close(averaged, expected.grad, rtol=1e-12, atol=1e-12)
    unweighted = model_copies(1)[0].double()
    torch.nn.functional.mse_loss(unweighted(x[:4]), y[:4]).backward()
    assert not all(torch.allclose(p.grad, q.grad) for p, q in zip(unweighted.parameters(), ranks[0].parameters()))


def test_at_the_even_share_the_gradient_is_left_alone_and_close_removes_the_hooks() -> None:
    plain, hooked = model_copies(2)
    weighted = GradientWeights(hooked)
    x = torch.randn(4, 5)
    for model in (plain, hooked):
        model(x).sum().backward()
    for p, q in zip(plain.parameters(), hooked.parameters()):
        assert torch.equal(p.grad, q.grad)
    weighted.scale = 3.0
    weighted.close()
    hooked.zero_grad()
    hooked(x).sum().backward()
    for p, q in zip(plain.parameters(), hooked.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_shares_follow_the_figures_once_every_window_is_full_and_noise_moves_nothing() -> None:
    sampler = ElasticSampler(1000, batch_size=8, seed=0)
    rebalancer = Rebalancer(sampler, window=3)
    assert rebalancer.observe([2000, 1000]) is None
    assert rebalancer.observe([2000, 0]) is None  # no figure from rank 1: its window is not full
    assert rebalancer.observe([2000, 1000]) is None
    assert rebalancer.observe([2000, 1000]) == (5, 11)  # rank 0 at half speed: about half the samples
    sampler.set_shares((5, 11))
    rng = random.Random(3)
    for _ in range(200):  # the same speeds, measured with noise: the cut stays
        assert rebalancer.observe([round(2000 * rng.uniform(0.95, 1.05)), round(1000 * rng.uniform(0.95, 1.05))]) is None
    for _ in range(3):  # rank 0 recovered: back to even
        changed = rebalancer.observe([1000, 1000])
    assert changed == (8, 8)


def test_a_bad_figure_from_a_peer_is_no_figure() -> None:
    rebalancer = Rebalancer(ElasticSampler(100, batch_size=4), window=1)
    assert rebalancer.observe([-1, 1000]) is None
    assert rebalancer.observe([10**13, 1000]) is None
    assert rebalancer.observe([True, 1000]) is None  # type: ignore[list-item]


def test_rebalancing_a_sharded_model_is_refused_in_one_line() -> None:
    import pytest

    from elastic._shared.common.errors import UsageError
    from elastic._worker.config import RunConfig
    from elastic._worker.observe import slow_ranks
    from elastic._worker.observe.events import EventLog
    from elastic._worker.runtime.context import WorkerContext

    ctx = WorkerContext(rank=0, local_rank=0, world_size=1, local_world_size=1, restart_count=0, run_id="t",
                        device=torch.device("cpu"), backend=None)
    model = torch.nn.Linear(2, 2)
    sampler = ElasticSampler(10, batch_size=2)
    events = EventLog(None, restart=0)
    original = slow_ranks._sharded
    slow_ranks._sharded = lambda p: True  # as FSDP2's DTensor parameters are
    try:
        with pytest.raises(UsageError, match="sharded"):
            slow_ranks.SlowRanks(ctx, RunConfig(slow_ranks="rebalance"), events, model, sampler=sampler)
    finally:
        slow_ranks._sharded = original
    assert not slow_ranks._sharded(model.weight)
    slow_ranks.SlowRanks(ctx, RunConfig(slow_ranks="report"), events, model, sampler=sampler).close()


def test_rebalance_refuses_a_fixed_size_loader_in_one_line_and_report_trains_as_before() -> None:
    import pytest
    from torch.utils.data import DataLoader

    import elastic

    with elastic.Run(device="cpu", slow_ranks="rebalance") as run:
        model = torch.nn.Linear(2, 1)
        run.start(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=16, batch_size=2)
        loader = DataLoader(list(range(16)), sampler=run.sampler_for_loader(), batch_size=2)
        with pytest.raises(elastic.UsageError, match="--slow-ranks rebalance needs the loader driven by run.batch_sampler"):
            next(iter(run.batches(loader, max_steps=2)))
    with elastic.Run(device="cpu", slow_ranks="evict") as run:  # evict rebalances too: the same line, its setting named
        model = torch.nn.Linear(2, 1)
        run.start(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=16, batch_size=2)
        loader = DataLoader(list(range(16)), sampler=run.sampler_for_loader(), batch_size=2)
        with pytest.raises(elastic.UsageError, match="--slow-ranks evict needs the loader driven by run.batch_sampler"):
            next(iter(run.batches(loader, max_steps=2)))
    with elastic.Run(device="cpu", slow_ranks="report") as run:  # the same loader trains under report
        model = torch.nn.Linear(2, 1)
        run.start(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=16, batch_size=2)
        loader = DataLoader(list(range(16)), sampler=run.sampler_for_loader(), batch_size=2)
        seen = [len(batch) for batch in run.batches(loader, max_steps=3)]
        assert seen == [2, 2, 2] and run.step == 3
