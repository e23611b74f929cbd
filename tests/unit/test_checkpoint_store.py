"""The on-disk commit protocol: atomic commit, verification, retention, quarantine."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest
import torch

from elastic.checkpoint.store import (
    MANIFEST,
    CheckpointStore,
    CorruptCheckpoint,
    Manifest,
    checkpoint_name,
    versions,
)
from elastic.errors import CheckpointError


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


def test_commit_writes_files_manifest_and_latest(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.prepare()
    path = commit(store, 7)
    assert path == tmp_path / "step_00000007"
    assert sorted(p.name for p in path.iterdir()) == [MANIFEST, "model.pt", "trainer.pt"]
    assert store.latest_pointer() == "step_00000007"
    (candidate,) = store.committed()
    manifest, state = store.load(candidate, map_location="cpu")
    assert manifest.step == 7 and manifest.world_size == 2 and manifest.consumed == 28
    assert set(manifest.files) == {"model.pt", "trainer.pt"}
    assert torch.equal(state["model.pt"]["w"], torch.full((4, 4), 7.0))
    assert state["trainer.pt"] == {"step": 7}
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
    _, state = store.load(candidate, map_location="cpu")
    assert torch.equal(state["model.pt"]["w"], torch.zeros(2))
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
    with pytest.raises(CorruptCheckpoint, match="does not deserialize"):
        store.load(candidate, map_location="cpu")


def test_prepare_reports_an_unusable_directory(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="cannot create checkpoint directory"):
        CheckpointStore(blocker / "ckpt").prepare()


def test_names_sort_by_step() -> None:
    assert checkpoint_name(42) == "step_00000042"
