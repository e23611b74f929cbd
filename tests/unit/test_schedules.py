from __future__ import annotations

import pytest
import torch

from elastic._worker.run.schedules import OneCycle, WarmupCosine


def test_warmup_rises_linearly_then_cosine_falls_to_the_floor() -> None:
    schedule = WarmupCosine(warmup_steps=4, total_steps=14, min_ratio=0.1)
    assert [schedule(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert schedule(9) == pytest.approx(0.55)  # halfway through the decay
    assert schedule(14) == pytest.approx(0.1) and schedule(100) == pytest.approx(0.1)


def test_scheduler_state_holds_only_plain_numbers() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(2, 10))
    opt.step()
    sched.step()
    state = sched.state_dict()
    assert state["lr_lambdas"] == [{"warmup_steps": 2, "total_steps": 10, "min_ratio": 0.1}]


def test_one_cycle_rises_to_the_peak_then_falls_far_below_the_start() -> None:
    schedule = OneCycle(warmup_steps=3, total_steps=10, div_factor=25, final_div_factor=1e4)
    assert schedule(0) == pytest.approx(1 / 25)
    assert schedule(3) == pytest.approx(1.0)
    values = [schedule(s) for s in range(11)]
    assert values[:4] == sorted(values[:4]) and values[3:] == sorted(values[3:], reverse=True)
    assert schedule(10) == pytest.approx(1 / 25 / 1e4) and schedule(50) == schedule(10)


def test_one_cycle_refuses_a_warmup_longer_than_the_run() -> None:
    with pytest.raises(ValueError, match="warmup_steps <= total_steps"):
        OneCycle(warmup_steps=11, total_steps=10)
