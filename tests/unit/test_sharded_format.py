"""The sharded tensor format (elastic/_shared/storage/sharded.py) and the flat live state (state.py).

Single-process round trips, corruption found by the per-block crc32c, no pickles,
and a real FSDP2 job on gloo: saved by 2 ranks, loaded by 1, 2 and 3 ranks.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from elastic._shared.common.errors import (
    CheckpointMismatchError,
    CorruptCheckpoint,
    UsageError,
)
from elastic._shared.storage import chunks, sharded, tensors_json
from elastic._worker.checkpoint import state as live_state


def assorted() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "model/f32": torch.randn(3, 5),
        "model/bf16": torch.randn(4, 2).to(torch.bfloat16),
        "model/i64": torch.arange(-3, 7, dtype=torch.int64) * (2**40),
        "model/scalar": torch.tensor(3.25),
        "model/empty": torch.empty(0, 3),
        "model/empty_i64": torch.empty(0, dtype=torch.int64),
        "model/uint8": torch.tensor([0, 1, 127, 128, 255], dtype=torch.uint8),
        "model/bool": torch.tensor([True, False, True]),
        "model/f64": torch.randn(2, 2, 2, dtype=torch.float64),
        "model/transposed": torch.randn(4, 6).t(),  # not contiguous
    }


def saved(tmp_path: Path, tensors: dict[str, torch.Tensor] | None = None) -> tuple[Path, Metadata, dict[str, torch.Tensor]]:
    tensors = assorted() if tensors is None else tensors
    directory = tmp_path / "ckpt"
    sharded.save_tensors(tensors, directory, group=None)
    metadata = tensors_json.metadata_from_json((directory / sharded.TENSORS_FILE).read_text(encoding="utf-8"))
    return directory, metadata, tensors


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def chunk_of(metadata: Metadata, fqn: str) -> tuple[Any, chunks.StoredChunk]:
    (index,) = [i for i in metadata.storage_data if i.fqn == fqn]
    return index, metadata.storage_data[index]


# -- single process --------------------------------------------------------------------


def test_round_trip_of_assorted_dtypes_in_one_process(tmp_path: Path) -> None:
    directory, metadata, tensors = saved(tmp_path)
    assert sorted(p.name for p in directory.iterdir()) == [sharded.shard_file(0), sharded.TENSORS_FILE]
    expected_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert (directory / sharded.shard_file(0)).stat().st_size == expected_bytes

    shapes = tensors_json.tensor_shapes(metadata)
    assert shapes == {key: (t.shape, t.dtype) for key, t in tensors.items()}
    out = sharded.full_tensors(directory, metadata, list(tensors))
    for key, tensor in tensors.items():
        assert out[key].dtype == tensor.dtype, key
        assert out[key].shape == tensor.shape, key
        assert torch.equal(out[key], tensor), key
    # Bit-exact, not just equal (bfloat16 and float64 bytes survive unchanged).
    assert out["model/bf16"].view(torch.int16).tolist() == tensors["model/bf16"].view(torch.int16).tolist()

    # A subset of keys loads on its own, and load_tensors counts only what it read.
    part = {"model/i64": torch.zeros(10, dtype=torch.int64)}
    read = sharded.load_tensors(part, directory, metadata, group=None)
    assert read == 80
    assert torch.equal(part["model/i64"], tensors["model/i64"])
    assert sharded.verify_tensors(directory, metadata) == expected_bytes


def test_save_returns_the_bytes_written_and_runs_the_hook_after_the_first_item(tmp_path: Path) -> None:
    calls: list[bool] = []
    directory = tmp_path / "ckpt"
    tensors = {"a": torch.ones(4), "b": torch.zeros(2, 2, dtype=torch.int64)}

    def hook() -> None:
        # The first item is already in the shard file, the metadata is not written yet.
        calls.append((directory / sharded.TENSORS_FILE).exists())

    written = sharded.save_tensors(tensors, directory, group=None, after_first_item=hook).bytes_written
    assert written == 16 + 32
    assert calls == [False]


def test_a_flipped_byte_is_corrupt_checkpoint_naming_the_file(tmp_path: Path) -> None:
    directory, metadata, tensors = saved(tmp_path)
    _, stored = chunk_of(metadata, "model/i64")
    shard = directory / stored.file
    flip_byte(shard, stored.offset + 5)

    with pytest.raises(CorruptCheckpoint, match=rf"ckpt/{stored.file} fails its crc32c check at model/i64"):
        chunks.read_chunk(directory, stored, "model/i64")
    with pytest.raises(CorruptCheckpoint, match=rf"{stored.file}.*model/i64"):
        sharded.verify_tensors(directory, metadata)
    # Through DCP: every rank gets DCP's CheckpointException; first_error digs out ours.
    with pytest.raises(CheckpointException) as caught:
        sharded.full_tensors(directory, metadata, list(tensors))
    cause = sharded.first_error(caught.value)
    assert isinstance(cause, CorruptCheckpoint), repr(caught.value)
    assert stored.file in str(cause) and "crc32c" in str(cause)
    # Chunks that were not touched still read.
    _, other = chunk_of(metadata, "model/f32")
    assert torch.equal(chunks.read_chunk(directory, other, "model/f32"), tensors["model/f32"])


def test_every_block_has_its_own_checksum(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sharded, "BLOCK", 64)
    tensor = torch.arange(250, dtype=torch.int32)  # 1000 bytes: 16 blocks, the last one short
    directory, metadata, _ = saved(tmp_path, {"w": tensor})
    _, stored = chunk_of(metadata, "w")
    assert len(stored.crc32c) == 16
    assert torch.equal(chunks.read_chunk(directory, stored, "w"), tensor)
    flip_byte(directory / stored.file, 999)  # in the last, short block
    with pytest.raises(CorruptCheckpoint, match="fails its crc32c check at w"):
        chunks.read_chunk(directory, stored, "w")


def test_a_truncated_or_missing_shard_is_corrupt(tmp_path: Path) -> None:
    directory, metadata, tensors = saved(tmp_path)
    shard = directory / sharded.shard_file(0)
    size = shard.stat().st_size
    os.truncate(shard, size - 3)
    last_index, last = max(metadata.storage_data.items(), key=lambda item: item[1].offset + item[1].length)
    with pytest.raises(CorruptCheckpoint, match=rf"ckpt/{sharded.shard_file(0)} is truncated: {last_index.fqn}"):
        chunks.read_chunk(directory, last, last_index.fqn)
    with pytest.raises(CorruptCheckpoint, match="is truncated"):
        sharded.verify_tensors(directory, metadata)
    with pytest.raises(CheckpointException) as caught:
        sharded.full_tensors(directory, metadata, list(tensors))
    assert isinstance(sharded.first_error(caught.value), CorruptCheckpoint)

    shard.unlink()
    with pytest.raises(CorruptCheckpoint, match=rf"{sharded.shard_file(0)} is missing"):
        sharded.verify_tensors(directory, metadata)


def test_a_mapped_read_gives_the_same_tensors_and_the_same_errors(tmp_path: Path) -> None:
    # Snapshot parts in memory are read through maps: bit-identical results, and a short file or
    # a flipped byte is the same CorruptCheckpoint as through read(), never a SIGBUS.
    directory, metadata, tensors = saved(tmp_path)
    targets = {key: torch.empty_like(t.contiguous()) for key, t in tensors.items()}
    read = sharded.load_tensors(targets, directory, metadata, group=None, source=chunks.MappedFiles(directory))
    assert read == sum(t.numel() * t.element_size() for t in tensors.values())
    for key, tensor in tensors.items():
        assert targets[key].reshape(-1).view(torch.uint8).tolist() == tensor.reshape(-1).view(torch.uint8).tolist(), key

    maps = chunks.MappedFiles(directory)
    _, stored = chunk_of(metadata, "model/f32")
    chunk, _ = chunks.read_rows(directory, stored, "model/f32", (1, 3), source=maps)
    assert torch.equal(chunk, tensors["model/f32"][1:3])
    del chunk
    maps.close()

    _, stored = chunk_of(metadata, "model/i64")
    flip_byte(directory / stored.file, stored.offset + 5)
    with pytest.raises(CorruptCheckpoint, match=rf"{stored.file} fails its crc32c check at model/i64"):
        chunks.read_rows(directory, stored, "model/i64", None, source=chunks.MappedFiles(directory))
    shard = directory / sharded.shard_file(0)
    os.truncate(shard, shard.stat().st_size - 3)
    last_index, last = max(metadata.storage_data.items(), key=lambda item: item[1].offset + item[1].length)
    with pytest.raises(CorruptCheckpoint, match=rf"{sharded.shard_file(0)} is truncated: {last_index.fqn}"):
        chunks.read_rows(directory, last, last_index.fqn, None, source=chunks.MappedFiles(directory))
    with pytest.raises(CheckpointException) as caught:
        sharded.load_tensors(targets, directory, metadata, group=None, source=chunks.MappedFiles(directory))
    assert isinstance(sharded.first_error(caught.value), CorruptCheckpoint)
    os.truncate(shard, 0)  # an empty file maps to nothing: truncated too
    with pytest.raises(CorruptCheckpoint, match="is truncated"):
        chunks.read_rows(directory, last, last_index.fqn, None, source=chunks.MappedFiles(directory))
    shard.unlink()
    with pytest.raises(CorruptCheckpoint, match=rf"{sharded.shard_file(0)} is missing"):
        chunks.read_rows(directory, last, last_index.fqn, None, source=chunks.MappedFiles(directory))


def test_tensors_json_is_json_without_pickles_and_round_trips(tmp_path: Path) -> None:
    directory, metadata, tensors = saved(tmp_path)
    # No DCP `.metadata` pickle, no torch.save zip: only raw bytes and JSON.
    assert not (directory / ".metadata").exists()
    for path in directory.iterdir():
        head = path.read_bytes()[:4]
        assert not head.startswith(b"\x80"), f"{path.name} starts like a pickle"
        assert not head.startswith(b"PK"), f"{path.name} is a zip (torch.save)"
    text = (directory / sharded.TENSORS_FILE).read_text(encoding="utf-8")
    raw = json.loads(text)
    assert raw["format"] == tensors_json.TENSORS_FORMAT
    assert set(raw["tensors"]) == set(tensors)
    assert raw["tensors"]["model/bf16"] == {"dtype": "torch.bfloat16", "size": [4, 2], "chunks": [{"offsets": [0, 0], "sizes": [4, 2]}]}
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads(text.encode())

    again = tensors_json.metadata_from_json(text)
    assert tensors_json.metadata_to_json(again) == text
    assert again.state_dict_metadata == metadata.state_dict_metadata
    assert again.storage_data == metadata.storage_data
    for fqn, md in again.state_dict_metadata.items():
        assert isinstance(md, TensorStorageMetadata)
        assert md.properties.dtype == tensors[fqn].dtype
        assert md.size == tensors[fqn].shape
    _, scalar = chunk_of(again, "model/scalar")
    assert scalar.sizes == () and scalar.length == 4


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda raw: raw.update(format=99), "has format 99"),
        (lambda raw: raw["tensors"]["w"].update(dtype="torch.Size"), "unknown dtype 'torch.Size'"),
        (lambda raw: raw["tensors"]["w"].update(dtype="os.system"), "unknown dtype"),
        (lambda raw: raw["chunks"][0].pop("crc32c"), "chunk 0 has no 'crc32c'"),
        (lambda raw: raw.update(tensors=[1, 2]), "tensors is a list, not an object"),
    ],
)
def test_metadata_that_is_not_ours_is_corrupt(tmp_path: Path, mutate: Callable[[dict], Any], message: str) -> None:
    directory, _, _ = saved(tmp_path, {"w": torch.ones(2)})
    raw = json.loads((directory / sharded.TENSORS_FILE).read_text(encoding="utf-8"))
    mutate(raw)
    with pytest.raises(CorruptCheckpoint, match=message):
        tensors_json.metadata_from_json(json.dumps(raw))


def test_first_error_is_the_failing_rank_s_own_exception() -> None:
    cause = CorruptCheckpoint("ckpt/shard_00001.bin fails its crc32c check at w")
    other = OSError(5, "Input/output error")
    wrapped = CheckpointException("read", {1: (other, None), 0: (cause, None)})  # type: ignore[dict-item]
    assert sharded.first_error(wrapped) is cause
    plain = ValueError("not from DCP")
    assert sharded.first_error(plain) is plain


def test_not_json_is_corrupt() -> None:
    with pytest.raises(CorruptCheckpoint, match="is not JSON"):
        tensors_json.metadata_from_json("\x80\x04garbage")


def test_a_byte_item_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    with pytest.raises(CheckpointException) as caught:
        sharded.save_tensors({"w": torch.ones(2), "blob": io.BytesIO(b"pickled")}, directory, group=None)  # type: ignore[dict-item]
    cause = sharded.first_error(caught.value)
    assert isinstance(cause, ValueError) and "blob is not a tensor" in str(cause)
    assert not (directory / sharded.TENSORS_FILE).exists()
    # A non-tensor value DCP would pickle is refused the same way.
    with pytest.raises(CheckpointException) as caught:
        sharded.save_tensors({"w": torch.ones(2), "step": 5}, tmp_path / "other", group=None)  # type: ignore[dict-item]
    assert "step is not a tensor" in str(sharded.first_error(caught.value))
    assert not (tmp_path / "other" / sharded.TENSORS_FILE).exists()
    # Metadata naming bytes cannot be written as JSON either.
    metadata = Metadata(state_dict_metadata={"blob": BytesStorageMetadata()})
    with pytest.raises(ValueError, match="blob is not a tensor"):
        tensors_json.metadata_to_json(metadata)
    assert sharded.is_bytes_metadata(BytesStorageMetadata())


def test_load_refuses_pickled_bytes() -> None:
    planner = sharded._LoadPlanner()

    class Item:
        class dest_index:
            fqn = "blob"

    with pytest.raises(CorruptCheckpoint, match="blob is stored as pickled bytes"):
        planner.load_bytes(Item(), io.BytesIO(pickle.dumps(object())))  # type: ignore[arg-type]


def test_a_passed_deadline_stops_the_read(tmp_path: Path) -> None:
    directory, metadata, tensors = saved(tmp_path)
    targets = {key: torch.empty_like(t) for key, t in tensors.items()}
    with pytest.raises(CheckpointException) as caught:
        sharded.load_tensors(targets, directory, metadata, group=None, deadline=time.monotonic() - 1)
    assert isinstance(sharded.first_error(caught.value), TimeoutError)


# -- state.py ----------------------------------------------------------------------------


def test_owners_is_deterministic_and_balances_bytes() -> None:
    assert live_state.owners({"a": 100, "b": 60, "c": 50, "d": 10}, 2) == {"a": 0, "b": 1, "c": 1, "d": 0}
    gen = torch.Generator().manual_seed(3)
    sizes = {f"k{i}": int(s) for i, s in enumerate(torch.randint(1, 10_000, (60,), generator=gen))}
    for world_size in (1, 2, 3, 5, 8):
        owner = live_state.owners(sizes, world_size)
        # The same answer whatever the order the keys come in (each rank computes it alone).
        reordered = dict(sorted(sizes.items(), key=lambda kv: kv[0], reverse=True))
        assert live_state.owners(reordered, world_size) == owner
        assert set(owner) == set(sizes) and set(owner.values()) <= set(range(world_size))
        load = [0] * world_size
        for key, rank in owner.items():
            load[rank] += sizes[key]
        # Greedy largest-first: no rank exceeds another by more than the largest item.
        assert max(load) - min(load) <= max(sizes.values())
        assert max(load) <= sum(sizes.values()) / world_size + max(sizes.values())
    # More ranks than keys: each key on its own rank.
    assert sorted(live_state.owners({"x": 5, "y": 5, "z": 1}, 8).values()) == [0, 1, 2]
    assert live_state.owners({}, 4) == {}


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))


def stepped(model: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(
        [{"params": list(model[0].parameters()), "lr": 0.1},
         {"params": list(model[1].parameters()) + list(model[2].parameters()), "lr": 0.01, "weight_decay": 0.0}]
    )
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return optimizer


def test_live_tensors_are_keyed_by_name_and_rebuild_the_optimizer() -> None:
    model = tiny_model()
    optimizer = stepped(model)
    live_state.check_supported(model, optimizer)
    live = live_state.live_tensors(model, optimizer)
    assert "model/1.running_mean" in live and "model/1.num_batches_tracked" in live
    assert "optim/2.weight/exp_avg" in live and "optim/0.bias/exp_avg_sq" in live and "optim/0.weight/step" in live
    assert torch.equal(live["model/0.weight"], model[0].weight)
    assert live_state.model_keys(live) == [k for k in live if k.startswith("model/")]
    settings = live_state.optimizer_settings(model, optimizer)
    assert settings["groups"][0]["params"] == ["0.weight", "0.bias"]
    json.dumps(settings)  # plain values only

    fresh_model = tiny_model()
    fresh = torch.optim.AdamW(
        [{"params": list(fresh_model[0].parameters())},
         {"params": list(fresh_model[1].parameters()) + list(fresh_model[2].parameters())}]
    )
    live_state.check_groups("step_1", fresh, fresh_model, settings)
    copies = {k: v.clone() for k, v in live.items()}
    fresh.load_state_dict(live_state.optimizer_state_dict(fresh_model, fresh, copies, settings))
    assert fresh.param_groups[0]["lr"] == 0.1 and fresh.param_groups[1]["weight_decay"] == 0.0
    assert live_state.live_tensors(fresh_model, fresh).keys() >= {k for k in live if k.startswith("optim/")}
    for key, value in live_state.live_tensors(fresh_model, fresh).items():
        if key.startswith("optim/"):
            assert torch.equal(value, live[key]), key


def test_check_shapes_and_groups_name_the_first_difference() -> None:
    model = tiny_model()
    optimizer = stepped(model)
    live = live_state.live_tensors(model, optimizer)
    shapes = {k: (v.shape, v.dtype) for k, v in live.items()}
    live_state.check_shapes("step_5", live, shapes, live_state.MODEL_PREFIX)
    live_state.check_shapes("step_5", live, shapes, live_state.OPTIM_PREFIX)

    wrong = {**shapes, "model/2.weight": (torch.Size([2, 7]), torch.float32)}
    with pytest.raises(CheckpointMismatchError, match=r"model 2.weight has shape \[2, 7\] there and \[2, 3\] here"):
        live_state.check_shapes("step_5", live, wrong, live_state.MODEL_PREFIX)
    missing = {k: v for k, v in shapes.items() if k != "model/0.bias"}
    with pytest.raises(CheckpointMismatchError, match="it has no 0.bias"):
        live_state.check_shapes("step_5", live, missing, live_state.MODEL_PREFIX)
    extra = {**shapes, "optim/extra/exp_avg": (torch.Size([1]), torch.float32)}
    with pytest.raises(CheckpointMismatchError, match="another optimizer: it has extra/exp_avg"):
        live_state.check_shapes("step_5", live, extra, live_state.OPTIM_PREFIX)

    settings = live_state.optimizer_settings(model, optimizer)
    with pytest.raises(CheckpointMismatchError, match="1 parameter groups there, 2 here"):
        live_state.check_groups("step_5", optimizer, model, {"groups": settings["groups"][:1]})
    swapped = [settings["groups"][0], {**settings["groups"][1], "params": settings["groups"][1]["params"][::-1]}]
    with pytest.raises(CheckpointMismatchError, match="group 1: the parameters are in another order"):
        live_state.check_groups("step_5", optimizer, model, {"groups": swapped})
    odd = [{**settings["groups"][0], "momentum": 0.9}, settings["groups"][1]]
    with pytest.raises(CheckpointMismatchError, match="setting 'momentum' of group 0"):
        live_state.check_groups("step_5", optimizer, model, {"groups": odd})


def _one_line_usage_error(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    with pytest.raises(UsageError) as caught:
        live_state.check_supported(model, optimizer)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_check_supported_refuses_zero_deepspeed_and_foreign_parameters() -> None:
    model = tiny_model()

    class ZeroRedundancyOptimizer(torch.optim.SGD):  # the name is what check_supported goes by
        pass

    assert "ZeroRedundancyOptimizer" in _one_line_usage_error(model, ZeroRedundancyOptimizer(model.parameters(), lr=0.1))

    DeepSpeedEngine = type("DeepSpeedEngine", (nn.Module,), {"__module__": "deepspeed.runtime.engine"})
    wrapped = nn.Sequential(model)
    wrapped.add_module("engine", DeepSpeedEngine())
    message = _one_line_usage_error(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1))
    assert "engine is a DeepSpeed DeepSpeedEngine" in message

    stranger = nn.Parameter(torch.ones(2))
    message = _one_line_usage_error(model, torch.optim.SGD([*model.parameters(), stranger], lr=0.1))
    assert "not the model's" in message


# -- real process groups ----------------------------------------------------------------
