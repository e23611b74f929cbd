"""A live peer's state header (a heal in place, elastic._worker.checkpoint.live_source) names every
tensor it will send; nothing is allocated for it until each one fits the local state it will be
loaded into: a model tensor its parameter, an optimizer tensor the optimizer's own state for that
parameter (a survivor's), or, where there is none yet (a replacement's fresh optimizer), its
parameter's shape or a scalar, a bounded number per parameter."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from elastic._worker.checkpoint import flat_broadcast, live_source
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
    monkeypatch.setattr(flat_broadcast, "BUCKET_BYTES", 100)
    f32, i64 = torch.float32, torch.int64
    shapes = [([5], f32), ([10], f32), ([20], f32), ([], f32), ([2], i64), ([30], f32), ([0], f32)]
    tensors = [torch.zeros(shape, dtype=dtype) for shape, dtype in shapes]
    # 20 + 40 bytes fit, 80 more do not; an int64 run of its own; 120 bytes alone, over the bound
    assert flat_broadcast.buckets(tensors) == [[0, 1], [2, 3], [4], [5], [6]]


def test_a_receiver_gets_each_tensor_bit_for_bit_in_its_own_storage(monkeypatch) -> None:
    """The packing and unpacking of `flat_broadcast.broadcast`, with the wire replaced by the source's flat buffers."""
    source = [torch.randn(3, 4), torch.randn(()), torch.arange(5), torch.randn(2, 3).t(), torch.randn(7, dtype=torch.float64)]
    sent: list[torch.Tensor] = []
    monkeypatch.setattr(flat_broadcast.dist, "broadcast", lambda flat, src, group=None: sent.append(flat.clone()))
    flat_broadcast.broadcast(source, 1, rank=1)  # the source sends, and its tensors are untouched
    wire = iter(sent)
    monkeypatch.setattr(flat_broadcast.dist, "broadcast", lambda flat, src, group=None: flat.copy_(next(wire)))
    received = [torch.full_like(t, -1) for t in source]
    flat_broadcast.broadcast(received, 1, rank=0)
    assert len(sent) == 4, "one broadcast per run of one dtype: float32 (3x4 and the scalar), int64, float32, float64"
    for want, got in zip(source, received):
        assert torch.equal(want, got) and got.dtype == want.dtype
    assert len({t.untyped_storage().data_ptr() for t in received}) == len(received), "no views of one buffer"
