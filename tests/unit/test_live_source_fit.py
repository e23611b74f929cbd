"""A live peer's state header (a heal in place, elastic._worker.checkpoint.live_source) names every
tensor it will send; nothing is allocated for it until each one fits the local state it will be
loaded into: a model tensor its parameter, an optimizer tensor the optimizer's own state for that
parameter (a survivor's), or, where there is none yet (a replacement's fresh optimizer), its
parameter's shape or a scalar, a bounded number per parameter."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from elastic._worker.checkpoint import live_source
from elastic._worker.checkpoint import state as live_state


def member(*, stepped: bool) -> SimpleNamespace:
    """A member's TrainingState as `_check_fits` reads it: a survivor's Adam has stepped, a replacement's not."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters())
    if stepped:
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
    return SimpleNamespace(model=model, optimizer=optimizer, layout=live_state.Layout(model, optimizer))


def sources_entries() -> list[tuple[str, torch.Size, torch.dtype]]:
    """What an honest source (a survivor of the same run) announces."""
    source = member(stepped=True)
    return [(key, t.shape, t.dtype) for key, t in source.layout.tensors().items()]


def trainer(state: SimpleNamespace) -> dict:
    return {"optimizer": live_state.optimizer_settings(state.model, state.optimizer), "sampler": {}}


@pytest.mark.parametrize("stepped", [True, False])
def test_an_honest_sources_state_fits_a_survivor_and_a_replacement(stepped: bool) -> None:
    state = member(stepped=stepped)
    live_source._check_fits(state, sources_entries(), trainer(state), 1)


def replaced(entries: list, key: str, shape: list[int], dtype: torch.dtype | None = None) -> list:
    return [(k, torch.Size(shape), dtype or d) if k == key else (k, s, d) for k, s, d in entries]


HUGE = [1 << 20, 1 << 20]  # 4 TiB of float32, were it allocated


@pytest.mark.parametrize("stepped", [True, False])
@pytest.mark.parametrize(("change", "why"), [
    (lambda e: replaced(e, "optim/weight/exp_avg", HUGE), "optimizer state weight/exp_avg"),
    (lambda e: replaced(e, "optim/weight/exp_avg", [2, 4], torch.float64), "weight/exp_avg"),
    (lambda e: replaced(e, "optim/bias/step", HUGE), "bias/step"),
    (lambda e: [*e, ("optim/weight/extra", torch.Size(HUGE), torch.float32)], "weight/extra"),
    (lambda e: [*e, ("optim/nothing/exp_avg", torch.Size([2]), torch.float32)], "nothing"),
    (lambda e: e + [e[0]] * 3, "more than once"),
    (lambda e: e + [(f"optim/bias/s{i}", torch.Size([]), torch.float32) for i in range(100)], "bias"),
])
def test_a_tensor_that_does_not_fit_the_local_state_is_one_line_before_any_allocation(
        stepped: bool, change, why: str) -> None:
    state = member(stepped=stepped)
    with pytest.raises(live_source.LivePeerError, match=why) as raised:
        live_source._check_fits(state, change(sources_entries()), trainer(state), 1)
    assert "\n" not in str(raised.value) and "rank 1" in str(raised.value)


def test_the_state_travels_in_buckets_of_one_dtype_each_within_the_bound(monkeypatch) -> None:
    monkeypatch.setattr(live_source, "BUCKET_BYTES", 100)
    f32, i64 = torch.float32, torch.int64
    entries = [("a", torch.Size([5]), f32), ("b", torch.Size([10]), f32), ("c", torch.Size([20]), f32),
               ("d", torch.Size([]), f32), ("e", torch.Size([2]), i64), ("f", torch.Size([30]), f32),
               ("g", torch.Size([0]), f32)]
    buckets = [[key for key, _, _ in bucket] for bucket in live_source._buckets(entries)]
    # 20 + 40 bytes fit, 80 more do not; an int64 run of its own; 120 bytes alone, over the bound
    assert buckets == [["a", "b"], ["c", "d"], ["e"], ["f"], ["g"]]
    assert [key for bucket in buckets for key in bucket] == [key for key, _, _ in entries], "the header's order"
