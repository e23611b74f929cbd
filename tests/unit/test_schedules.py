from __future__ import annotations

import pytest
import torch

from elastic.schedules import WarmupCosine


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
