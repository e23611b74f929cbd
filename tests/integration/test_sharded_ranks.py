"""Sharded (FSDP2/DTensor) state through the state manager on real gloo ranks: what two ranks save loads
at one, two and three (uneven shards), a restore that reshards reads each row it needs once, and FSDP1
and ZeroRedundancyOptimizer are refused in one line each. Each job's ranks are processes
(rank_processes), their results written to files the test compares."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rank_processes import run_ranks
from torch import nn
from torch.distributed.checkpoint.metadata import (
    Metadata,
)

from elastic._shared.common.errors import UsageError
from elastic._shared.storage import sharded, tensors_json
from elastic._worker.checkpoint import state as live_state


def run_job(target: Callable[..., None], world_size: int, *args: Any, timeout: float = 120) -> None:
    """`target(rank, world_size, store_path, *args)` in `world_size` processes on gloo."""
    store_path = args[0] / f"store.{target.__name__}.{world_size}"
    run_ranks(target, world_size, world_size, str(store_path), *args, timeout=timeout)


BLOCK_ENV = "TEST_SHARDED_BLOCK"
"""`sharded.BLOCK` in the ranks, when a test sets it (ranks see the test's environment, not its patches)."""


def _init(rank: int, world_size: int, store_path: str) -> None:
    torch.set_num_threads(1)
    if os.environ.get(BLOCK_ENV):
        sharded.BLOCK = int(os.environ[BLOCK_ENV])
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)


def _fsdp2_model(world_size: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 5))  # 5 rows: uneven shards at 2 and 3 ranks
    model.register_buffer("count", torch.arange(3))
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if isinstance(v, sharded.DTensor) else v.clone() for k, v in tensors.items()}


def _targets(model: nn.Module, metadata: Metadata, rank: int, world_size: int, *, plain_by_owner: bool) -> dict[str, torch.Tensor]:
    """What the manager loads into: DTensor buffers sharded like the live parameters; plain tensors
    by their owner only (or on every rank)."""
    params = dict(model.named_parameters())
    live = {live_state.MODEL_PREFIX + k: v for k, v in model.state_dict().items()}
    targets: dict[str, torch.Tensor] = {}
    plain: dict[str, tuple[torch.Size, torch.dtype]] = {}
    for key, (shape, dtype) in tensors_json.tensor_shapes(metadata).items():
        like = live.get(key)
        if like is None:
            like = params[key[len(live_state.OPTIM_PREFIX):].rsplit("/", 1)[0]]
            like = like if like.shape == shape else None
        if isinstance(like, sharded.DTensor):
            targets[key] = live_state.host_buffer_like(like, dtype=dtype)
        else:
            plain[key] = (shape, dtype)
    owner = live_state.owners({k: s.numel() * d.itemsize for k, (s, d) in plain.items()}, world_size)
    for key, (shape, dtype) in plain.items():
        if owner[key] == rank or not plain_by_owner:
            targets[key] = torch.empty(shape, dtype=dtype)
    return targets


def _save_on_two_ranks(rank: int, world_size: int, store_path: str, tmp: Path) -> None:
    _init(rank, world_size, store_path)
    try:
        model = _fsdp2_model(world_size)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        torch.manual_seed(1)
        model(torch.randn(4, 6)).sum().backward()
        optimizer.step()
        live_state.check_supported(model, optimizer)
        live = live_state.live_tensors(model, optimizer)
        mine = live_state.share_of(live, rank, world_size)
        written = sharded.save_tensors(mine, tmp / "ckpt", group=dist.group.WORLD).bytes_written
        reference = _full(live)
        if rank == 0:
            torch.save(reference, tmp / "reference.pt")

        # Restore at the same world size, the manager's way: each byte read once in all.
        metadata = tensors_json.metadata_from_json((tmp / "ckpt" / sharded.TENSORS_FILE).read_text(encoding="utf-8"))
        targets = _targets(model, metadata, rank, world_size, plain_by_owner=True)
        read = sharded.load_tensors(targets, tmp / "ckpt", metadata, group=dist.group.WORLD)
        restored = _full(targets)
        torch.save(
            {"written": written, "read": read, "restored": restored,
             "local": {k: sharded.local_part(v).clone() for k, v in targets.items()},
             "live_local": {k: sharded.local_part(v).clone() for k, v in live.items()}},
            tmp / f"two.{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def _load_on_three_ranks(rank: int, world_size: int, store_path: str, tmp: Path) -> None:
    _init(rank, world_size, store_path)
    try:
        model = _fsdp2_model(world_size)
        metadata = tensors_json.metadata_from_json((tmp / "ckpt" / sharded.TENSORS_FILE).read_text(encoding="utf-8"))
        targets = _targets(model, metadata, rank, world_size, plain_by_owner=False)
        read = sharded.load_tensors(targets, tmp / "ckpt", metadata, group=dist.group.WORLD)
        shapes = {k: tuple(sharded.local_part(v).shape) for k, v in targets.items()}
        torch.save({"read": read, "restored": _full(targets), "local_shapes": shapes}, tmp / f"three.{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_fsdp2_state_saved_by_two_ranks_loads_at_one_two_and_three(tmp_path: Path) -> None:
    run_job(_save_on_two_ranks, 2, tmp_path)
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == [sharded.shard_file(0), sharded.shard_file(1), sharded.TENSORS_FILE]
    reference: dict[str, torch.Tensor] = torch.load(tmp_path / "reference.pt")
    assert {"model/0.weight", "model/count", "optim/2.weight/exp_avg", "optim/2.weight/step"} <= set(reference)
    two = [torch.load(tmp_path / f"two.{rank}.pt") for rank in range(2)]

    # Each rank wrote its own file; every byte once.
    shard_bytes = [(ckpt / sharded.shard_file(r)).stat().st_size for r in range(2)]
    assert [t["written"] for t in two] == shard_bytes
    payload = sum(t.numel() * t.element_size() for t in reference.values())
    assert sum(shard_bytes) == payload
    # Both ranks wrote: sharded tensors split across the files, plain ones spread by owner.
    assert min(shard_bytes) > 0

    # World size 2: each byte read once in all, and each rank got back its own shards.
    assert sum(t["read"] for t in two) == sum(shard_bytes)
    for rank, result in enumerate(two):
        for key, local in result["local"].items():
            assert torch.equal(local, result["live_local"][key]), (rank, key)
        for key, value in result["restored"].items():
            assert torch.equal(value, reference[key]), (rank, key)
    # Plain tensors (the buffer, AdamW's step counts) are read by their owner only, and both ranks own some.
    plain = {key for key in reference if key == "model/count" or key.endswith("/step")}
    assert set(two[0]["local"]) & set(two[1]["local"]) == set(reference) - plain
    assert set(two[0]["local"]) ^ set(two[1]["local"]) == plain
    assert plain & set(two[0]["local"]) and plain & set(two[1]["local"])

    # World size 1, no process group: whole tensors from both ranks' files.
    metadata = tensors_json.metadata_from_json((ckpt / sharded.TENSORS_FILE).read_text(encoding="utf-8"))
    assert {k: v[0] for k, v in tensors_json.tensor_shapes(metadata).items()} == {k: v.shape for k, v in reference.items()}
    whole = sharded.full_tensors(ckpt, metadata, list(reference))
    for key, value in reference.items():
        assert torch.equal(whole[key], value), key
    assert sharded.verify_tensors(ckpt, metadata) == sum(shard_bytes)

    # World size 3: DCP reshards 5 rows saved as 3+2 into 2+2+1.
    run_job(_load_on_three_ranks, 3, tmp_path)
    three = [torch.load(tmp_path / f"three.{rank}.pt") for rank in range(3)]
    assert [t["local_shapes"]["model/2.weight"] for t in three] == [(2, 10), (2, 10), (1, 10)]
    for rank, result in enumerate(three):
        assert set(result["restored"]) == set(reference)
        for key, value in reference.items():
            assert torch.equal(result["restored"][key], value), (rank, key)


def _real_fsdp1_and_zero(rank: int, world_size: int, store_path: str, tmp: Path) -> None:
    _init(rank, world_size, store_path)
    messages: dict[str, str] = {}
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.optim import ZeroRedundancyOptimizer

        torch.manual_seed(0)
        inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        wrapped = FullyShardedDataParallel(inner, device_id=torch.device("cpu"))
        for name, model, make in [
            ("fsdp1", wrapped, lambda m: torch.optim.SGD(m.parameters(), lr=0.1)),
            ("zero", nn.Linear(3, 3), lambda m: ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)),
        ]:
            try:
                live_state.check_supported(model, make(model))
                messages[name] = "accepted"
            except UsageError as exc:
                messages[name] = str(exc)
    finally:
        torch.save(messages, tmp / "refusals.pt")
        dist.destroy_process_group()


def test_check_supported_refuses_real_fsdp1_and_zero_redundancy_optimizer(tmp_path: Path) -> None:
    run_job(_real_fsdp1_and_zero, 1, tmp_path)
    messages = torch.load(tmp_path / "refusals.pt")
    assert messages["fsdp1"].startswith("the model is wrapped in FSDP1 (FullyShardedDataParallel)"), messages
    assert "fully_shard" in messages["fsdp1"] and "\n" not in messages["fsdp1"]
    assert messages["zero"].startswith("ZeroRedundancyOptimizer shards its state"), messages
    assert "\n" not in messages["zero"]


def test_a_restore_that_reshards_reads_the_rows_it_needs_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One float per checksum block: every row boundary is a block boundary, so reading only a
    # rank's rows is exact.
    monkeypatch.setenv(BLOCK_ENV, "4")
    run_job(_save_on_two_ranks, 2, tmp_path)
    run_job(_load_on_three_ranks, 3, tmp_path)
    reference: dict[str, torch.Tensor] = torch.load(tmp_path / "reference.pt")
    plain = {key for key in reference if key == "model/count" or key.endswith("/step")}
    sharded_bytes = sum(t.numel() * t.element_size() for key, t in reference.items() if key not in plain)
    plain_bytes = sum(reference[key].numel() * reference[key].element_size() for key in plain)
    three = [torch.load(tmp_path / f"three.{rank}.pt") for rank in range(3)]
    # 5 rows saved as 3+2 and loaded as 2+2+1: the middle rank needs a row of each saved chunk;
    # reading whole chunks would read the sharded bytes twice. (Every rank read the plain ones here.)
    assert sum(t["read"] for t in three) == sharded_bytes + 3 * plain_bytes
    for result in three:
        for key, value in reference.items():
            assert torch.equal(result["restored"][key], value), key
