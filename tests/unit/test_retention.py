"""Retention counts only verified checkpoints of this run, and deletes nothing once the claim is
lost (elastic/_shared/storage/retention.py, reached through CheckpointStore.finish and commit_checkpoint)."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from store_helpers import save

from elastic._shared.storage import retention
from elastic._shared.storage.claim import WRITER, WriterIdentity
from elastic._shared.storage.commit import commit_checkpoint
from elastic._shared.storage.directory import CheckpointStore
from elastic._shared.storage.durable import SaveFailed, replace_small
from elastic._shared.storage.manifest import MANIFEST, Manifest, checkpoint_name


def steps(store: CheckpointStore) -> list[int]:
    return [c.step for c in store.committed()]


def craft(store: CheckpointStore, step: int, like: Path, *, run_id: str | None = None, damage: bool = False) -> Path:
    """A copy of checkpoint `like` named as `step`: another run's, or damaged where only a full read sees it."""
    target = store.root / checkpoint_name(step)
    shutil.copytree(like, target)
    manifest = Manifest.from_json((target / MANIFEST).read_text())
    fields = {**manifest.__dict__, "step": step, **({"run_id": run_id} if run_id else {})}
    (target / MANIFEST).write_text(Manifest(**fields).to_json())
    if damage:
        shard = next(target.glob("shard_*"))
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    return target


def test_crafted_and_foreign_checkpoints_never_count_towards_keep(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    owner = WriterIdentity.new("run-a")
    store.prepare(owner)
    good = save(store, 100, owner=owner)
    save(store, 200, owner=owner)
    craft(store, 300, good, damage=True)  # this run's id, sizes right, a chunk wrong
    craft(store, 400, good, run_id="run-b")  # verifies, but another run's
    (tmp_path / checkpoint_name(450)).mkdir()  # no manifest at all
    save(store, 500, owner=owner)
    # Kept: 500 and 200, the newest two of run-a that verify; nothing newer than 200 was counted or deleted.
    assert steps(store) == [500, 450, 400, 300, 200]
    save(store, 600, owner=owner)
    # 200 is behind the newest two verified (600, 500): it goes; what is not recognisably a checkpoint stays.
    assert steps(store) == [600, 500, 450]


def test_the_newest_verified_checkpoint_of_this_run_stays_whatever_is_newer(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    owner = WriterIdentity.new("run-a")
    store.prepare(owner)
    first = save(store, 100, owner=owner)
    for step in (200, 300, 400):
        craft(store, step, first, damage=True)
    save(store, 500, owner=owner)
    assert 100 in steps(store), "a verified checkpoint is never pushed out by ones that do not verify"


def test_nothing_is_deleted_once_the_claim_is_another_writer_s(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=1)
    owner = WriterIdentity.new("run-a")
    store.prepare(owner)
    for step in (100, 200):
        save(store, step, owner=owner)
    craft(store, 50, store.root / checkpoint_name(200))
    thief = replace(WriterIdentity.new("run-b"), writer="th1efth1ef00")
    replace_small(tmp_path, WRITER, thief.to_json())
    assert retention.retire_old(store, "run-a", owner) == []
    assert retention.retire_old(store, "run-a", None) == [], "a keeper of run-a neither"
    assert steps(store) == [200, 50]
    # Back in run-a's hands (a keeper commits for its job), old ones go again.
    replace_small(tmp_path, WRITER, replace(thief, run_id="run-a").to_json())
    assert retention.retire_old(store, "run-a", None) == [checkpoint_name(50)]


def test_a_keeper_s_commit_prunes_only_in_its_job_s_directory(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=1)
    owner = WriterIdentity.new("run-b")
    store.prepare(owner)
    save(store, 100, owner=owner)
    stage = store.begin(200, "keeper")
    stage.mkdir()
    (stage / "shard_00000.bin").write_bytes(b"")
    with pytest.raises(SaveFailed, match="nothing of run run-a is committed there"):
        commit_checkpoint(
            store, stage, step=200, world_size=1, shard_sizes={}, tensors_json=b"{}",
            trainer={"sampler": {"epoch": 0, "consumed": 0}}, reason="breakpoint", run_id="run-a",
        )
    assert steps(store) == [100] and not stage.exists()


def test_each_checkpoint_is_read_whole_once_per_process(tmp_path: Path, monkeypatch) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    owner = WriterIdentity.new("run-a")
    store.prepare(owner)
    first = save(store, 100, owner=owner)
    craft(store, 150, first)  # made by hand: not verified yet
    verified = []
    real = CheckpointStore.verify
    monkeypatch.setattr(CheckpointStore, "verify", lambda self, c: verified.append(c.step) or real(self, c))
    for step in (200, 300):
        save(store, step, owner=owner)
    assert verified == [150], "commits of this process count as verified; others are read once"
    assert steps(store) == [300, 200, 150]


def test_a_manifest_of_the_wrong_step_does_not_count(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=1)
    owner = WriterIdentity.new("run-a")
    store.prepare(owner)
    path = save(store, 100, owner=owner)
    copied = store.root / checkpoint_name(200)
    shutil.copytree(path, copied)  # a manifest that says step 100 under step 200's name
    save(store, 300, owner=owner)
    assert steps(store) == [300, 200], "100 goes behind 300; the misnamed copy neither counts nor goes"
