"""What a checkpoint takes from the live state: tied weights once, modules' extra state,
and DTensor shards copied into host buffers that stay on the host (on a CUDA mesh too)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic._shared.common.errors import CheckpointMismatchError
from elastic._worker.checkpoint import CheckpointManager, read_checkpoint
from elastic._worker.checkpoint import state as live_state
from elastic._worker.checkpoint.snapshot import BufferPool, plan_copies
from elastic._worker.config import RunConfig
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.runtime.context import init_worker


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight


class WithExtraState(nn.Module):
    """A module that keeps non-tensor state through get/set_extra_state (as FP8 recipes do)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.scale_history = [1.0]

    def get_extra_state(self) -> dict:
        return {"history": list(self.scale_history)}

    def set_extra_state(self, state: dict) -> None:
        self.scale_history = list(state["history"])


def manager(tmp_path: Path, model: nn.Module) -> CheckpointManager:
    ctx = init_worker("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    sampler = ElasticSampler(20, batch_size=2, seed=0)
    return CheckpointManager(
        ctx, RunConfig(ckpt_dir=tmp_path / "ckpt", ckpt_every=0, snapshot_every=0), model=model, optimizer=optimizer,
        sampler=sampler,
    )


def step(model: nn.Module, ckpt: CheckpointManager) -> None:
    loss = sum(p.float().sum() for p in model.parameters())
    loss.backward()
    ckpt.state.optimizer.step()


def test_a_tied_weight_is_saved_once_and_comes_back_tied(tmp_path: Path) -> None:
    model = Tied()
    assert live_state.tied_aliases(model) == {"model/head.weight": "model/embed.weight"}
    assert "model/head.weight" not in live_state.live_tensors(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt = manager(tmp_path, model)
    step(model, ckpt)
    ckpt.save(1, reason="final")
    ckpt.flush()
    ckpt.close()
    _, tensors, _ = read_checkpoint(tmp_path / "ckpt" / "step_00000001")
    assert torch.equal(tensors["model/head.weight"], model.embed.weight.detach())  # the reader names both
    shard = (tmp_path / "ckpt" / "step_00000001" / "shard_00000.bin").stat().st_size
    once = sum(t.numel() * t.element_size() for k, t in tensors.items() if k != "model/head.weight")
    assert shard == once, "the tied embedding is written once"

    fresh = Tied()
    restored = manager(tmp_path, fresh)
    assert restored.restore() == 1
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, model.embed.weight)
    restored.close()

    untied = Tied()
    untied.head.weight = nn.Parameter(untied.embed.weight.detach().clone())
    other = manager(tmp_path, untied)
    with pytest.raises(CheckpointMismatchError, match="is for another model: it has no head.weight"):
        other.restore()
    other.close()


def test_module_extra_state_is_saved_and_set_back(tmp_path: Path) -> None:
    model = WithExtraState()
    model.scale_history = [1.0, 0.5, 0.25]
    ckpt = manager(tmp_path, model)
    step(model, ckpt)
    ckpt.save(1, reason="final")
    ckpt.flush()
    ckpt.close()
    fresh = WithExtraState()
    restored = manager(tmp_path, fresh)
    assert restored.restore() == 1
    assert fresh.scale_history == [1.0, 0.5, 0.25]
    assert torch.equal(fresh.linear.weight, model.linear.weight)
    restored.close()


@pytest.fixture
def one_rank_group(monkeypatch: pytest.MonkeyPatch):
    # Through monkeypatch: left in os.environ, RANK and WORLD_SIZE made every later elastic.Run of the
    # process a distributed one (test_run's SIGTERM test then stopped at a vote step, not the next step).
    for name, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000), RANK="0", WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_dtensor_copies_stay_in_host_buffers_on_a_cuda_mesh(one_rank_group: None) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    # A CUDA mesh without a GPU: nothing may move to the device (DTensor.from_local would).
    mesh = DeviceMesh("cuda", [0], _init_backend=False)
    live = DTensor.from_local(torch.empty(4, 3, device="meta"), mesh, [Shard(0)], run_check=False)
    pool = BufferPool(pin_memory=False)
    tree, copies = plan_copies({"w": live}, pool, "later")
    snapshot = tree["w"]
    assert isinstance(snapshot, DTensor) and snapshot.device_mesh is mesh
    (source, buffer), = copies
    assert snapshot.to_local().data_ptr() == buffer.data_ptr(), "the snapshot is the buffer the copy fills later"
    assert snapshot.to_local().device.type == "cpu"
    host = live_state.host_buffer_like(live, dtype=torch.float64)
    assert host.to_local().device.type == "cpu" and host.dtype == torch.float64 and host.shape == live.shape


def test_state_that_may_differ_per_rank_is_saved_from_rank_0() -> None:
    tensors = {f"model/b{i}": torch.zeros(10 * (i + 1)) for i in range(4)}
    pinned = frozenset({"model/b0", "model/b3"})
    shares = [live_state.share_of(tensors, rank, 3, from_rank0=pinned) for rank in range(3)]
    assert pinned <= set(shares[0]) and not pinned & (set(shares[1]) | set(shares[2]))
    assert sorted(k for share in shares for k in share) == sorted(tensors), "each saved once"
