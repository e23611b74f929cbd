"""The on-disk commit protocol: atomic commit, verification, retention, quarantine."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import crc32c
import pytest
import torch

from elastic._shared.common.errors import CheckpointError, CorruptCheckpoint
from elastic._shared.storage import sharded
from elastic._shared.storage.directory import CheckpointStore
from elastic._shared.storage.manifest import (
    MANIFEST,
    Manifest,
    checkpoint_name,
    versions,
)
from elastic._worker.checkpoint import read_checkpoint


def describe_for(step: int):
    def describe(files):
        return Manifest(
            step=step, epoch=0, consumed=step * 4, world_size=2, files=files, created=time.time(),
            reason="periodic", run_id="test", versions=versions(),
        )
    return describe


def commit(store: CheckpointStore, step: int, **kwargs) -> Path:
    files = {"model.pt": {"w": torch.full((4, 4), float(step))}, "trainer.pt": {"step": step}}
    return store.commit(step, files, describe=describe_for(step), **kwargs)


def commit_sharded(store: CheckpointStore, step: int) -> Path:
    """A format-2 checkpoint as CheckpointManager writes one: shards through DCP, tensors.json, trainer.pt."""
    tmp = store.begin(step, "test")
    tensors = {"model/w": torch.full((4, 4), float(step)), "optim/w/exp_avg": torch.full((4, 4), -float(step))}
    sharded.save_tensors(tensors, tmp, group=None)
    files = {p.name: {"bytes": p.stat().st_size} for p in tmp.glob(sharded.SHARD_PREFIX + "*")}
    metadata = (tmp / sharded.TENSORS_FILE).read_bytes()
    files[sharded.TENSORS_FILE] = {"bytes": len(metadata), "crc32c": crc32c.crc32c(metadata)}
    files["trainer.pt"] = store.write_state_file(tmp, "trainer.pt", {"step": step})
    return store.finish(tmp, describe_for(step)(files))


def test_commit_writes_files_manifest_and_latest(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.prepare()
    path = commit(store, 7)
    assert path == tmp_path / "step_00000007"
    assert sorted(p.name for p in path.iterdir()) == [MANIFEST, "model.pt", "trainer.pt"]
    assert store.latest_pointer() == "step_00000007"
    (candidate,) = store.committed()
    manifest = store.verify(candidate)
    assert manifest.step == 7 and manifest.world_size == 2 and manifest.consumed == 28
    assert manifest.format == 1, "commit() writes the format of releases before 0.3"
    assert set(manifest.files) == {"model.pt", "trainer.pt"}
    assert all("sha256" in f for f in manifest.files.values())
    assert torch.equal(store.load_state_file(candidate, manifest, "model.pt")["w"], torch.full((4, 4), 7.0))
    assert store.load_state_file(candidate, manifest, "trainer.pt") == {"step": 7}
    assert not list(tmp_path.glob(".tmp*")), "no temporary directory remains after a commit"


def test_keeps_only_the_newest_k_and_deletes_after_commit(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    for step in (10, 20, 30, 40):
        commit(store, step)
    assert [c.name for c in store.committed()] == ["step_00000040", "step_00000030"]


def test_a_crash_before_the_commit_leaves_only_a_temporary_directory(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    commit(store, 10)

    class Died(Exception):
        pass

    def die() -> None:
        raise Died

    with pytest.raises(Died):
        commit(store, 20, before_commit=die)
    (tmp,) = tmp_path.glob(".tmp.step_00000020.*")
    assert (tmp / MANIFEST).exists(), "the dead save got as far as its manifest"
    assert [c.step for c in store.committed()] == [10], "a directory without a commit is never listed"
    assert store.latest_pointer() == "step_00000010"
    store.prepare()  # what a restarted job does first
    assert not tmp.exists()


def test_recommitting_a_step_replaces_it(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    commit(store, 5)
    store.commit(5, {"model.pt": {"w": torch.zeros(2)}}, describe=describe_for(5))
    (candidate,) = store.committed()
    manifest = store.verify(candidate)
    assert torch.equal(store.load_state_file(candidate, manifest, "model.pt")["w"], torch.zeros(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000005"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_damage_is_detected(tmp_path: Path, damage: str) -> None:
    store = CheckpointStore(tmp_path)
    path = commit(store, 3)
    target = path / "model.pt"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-10])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    elif damage == "delete":
        target.unlink()
    else:
        (path / MANIFEST).write_text("{not json")
    (candidate,) = store.committed()
    with pytest.raises(CorruptCheckpoint, match="step_00000003"):
        store.verify(candidate)


def test_a_sharded_checkpoint_verifies_and_reads_back(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.prepare()
    path = commit_sharded(store, 7)
    assert sorted(p.name for p in path.iterdir()) == [MANIFEST, "shard_00000.bin", "tensors.json", "trainer.pt"]
    assert store.latest_pointer() == "step_00000007"
    (candidate,) = store.committed()
    manifest = store.verify(candidate)
    assert manifest.format == 2 and manifest.step == 7 and manifest.consumed == 28
    assert manifest.files["shard_00000.bin"] == {"bytes": 128}, "a shard's chunks carry their own crc32c"
    assert "crc32c" in manifest.files["tensors.json"] and "crc32c" in manifest.files["trainer.pt"]
    read, tensors, trainer = read_checkpoint(path)
    assert read == manifest and trainer == {"step": 7}
    assert torch.equal(tensors["model/w"], torch.full((4, 4), 7.0))
    assert torch.equal(tensors["optim/w/exp_avg"], torch.full((4, 4), -7.0))
    assert not list(tmp_path.glob(".tmp*")), "no temporary directory remains after a commit"


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "tensors.json", "trainer.pt"])
def test_damage_to_a_sharded_checkpoint_is_detected(tmp_path: Path, damage: str) -> None:
    store = CheckpointStore(tmp_path)
    path = commit_sharded(store, 3)
    target = path / ("shard_00000.bin" if damage in ("truncate", "flip", "delete") else damage)
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-10])
    elif damage == "delete":
        target.unlink()
    else:
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    (candidate,) = store.committed()
    with pytest.raises(CorruptCheckpoint, match="step_00000003"):
        store.verify(candidate)
    with pytest.raises(CheckpointError, match="does not verify"):
        read_checkpoint(path)


def test_quarantine_moves_a_checkpoint_aside(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    commit(store, 1)
    commit(store, 2)
    newest = store.committed()[0]
    moved = store.quarantine(newest)
    assert moved.name == "step_00000002.corrupt" and moved.is_dir()
    assert [c.step for c in store.committed()] == [1]


def test_only_tensors_and_plain_types_are_loaded(tmp_path: Path) -> None:
    """A file holding a pickled object is refused by weights_only loading: it counts as corrupt."""
    store = CheckpointStore(tmp_path)
    store.commit(4, {"trainer.pt": {"obj": argparse.Namespace(code="anything")}}, describe=describe_for(4))
    (candidate,) = store.committed()
    manifest = store.verify(candidate)  # every byte is as written
    with pytest.raises(CorruptCheckpoint, match="does not deserialize"):
        store.load_state_file(candidate, manifest, "trainer.pt")


def test_prepare_reports_an_unusable_directory(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="cannot create checkpoint directory"):
        CheckpointStore(blocker / "ckpt").prepare()


def test_names_sort_by_step() -> None:
    assert checkpoint_name(42) == "step_00000042"
