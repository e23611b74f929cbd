"""The checkpoint directory's safety rules (elastic/_shared/storage/directory.py, claim.py): the writer claim,
`latest` read before the listing, replacing a step without a gap, bounded quarantine,
and format-2 checkpoints written with begin/write_state_file/finish."""

from __future__ import annotations

import os
import time
from pathlib import Path

import crc32c
import pytest
import torch
from store_helpers import claim_of, leftovers, save, weights

from elastic._shared.common.errors import CheckpointStorageError, CorruptCheckpoint
from elastic._shared.storage import directory as store_module
from elastic._shared.storage import sharded
from elastic._shared.storage.claim import WRITER, WriterIdentity
from elastic._shared.storage.directory import LATEST, CheckpointStore
from elastic._shared.storage.durable import SaveFailed, replace_small
from elastic._shared.storage.manifest import MANIFEST, Manifest, checkpoint_name

# -- format-2 checkpoints through the store --------------------------------------------------


def test_state_files_carry_a_crc32c_and_a_format_2_checkpoint_verifies(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.prepare(WriterIdentity.new("run-a"))
    path = save(store, 10)
    manifest = Manifest.from_json((path / MANIFEST).read_text())
    assert manifest.format == 2
    trainer = manifest.files["trainer.pt"]
    data = (path / "trainer.pt").read_bytes()
    assert trainer == {"bytes": len(data), "crc32c": crc32c.crc32c(data)}
    assert "crc32c" not in manifest.files[sharded.shard_file(0)]  # its chunks are checked from tensors.json
    (candidate,) = store.committed()
    assert store.load_state_file(candidate, manifest, "trainer.pt") == {"step": 10, "fill": 10.0}
    assert torch.equal(weights(store, 10), torch.full((8, 4), 10.0))
    assert store.latest_pointer() == checkpoint_name(10)
    assert not list(tmp_path.glob(".tmp.*"))


@pytest.mark.parametrize("victim", ["trainer.pt", sharded.TENSORS_FILE, "shard"])
def test_a_flipped_byte_in_a_format_2_checkpoint_is_found(tmp_path: Path, victim: str) -> None:
    store = CheckpointStore(tmp_path)
    store.prepare()
    path = save(store, 10)
    name = sharded.shard_file(0) if victim == "shard" else victim
    data = bytearray((path / name).read_bytes())
    data[len(data) // 2] ^= 0x10
    (path / name).write_bytes(bytes(data))
    (candidate,) = store.committed()
    with pytest.raises(CorruptCheckpoint, match=f"{name}"):
        store.verify(candidate)


def test_abort_removes_the_temporary_directory(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.prepare()
    tmp = store.begin(5, "abc")
    assert tmp.name == ".tmp.step_00000005.abc"
    store.write_state_file(tmp, "trainer.pt", {"step": 5})
    store.abort(tmp)
    assert not tmp.exists() and store.committed() == []


def test_prepare_removes_every_save_that_never_committed_files_included(tmp_path: Path) -> None:
    """A kill between writing the `latest` pointer's new copy and its rename leaves a file, not a
    directory: the next start removes it too (found by a chaos job whose kill landed there)."""
    (tmp_path / ".tmp.step_00000005.abc").mkdir()
    (tmp_path / ".tmp.latest.a428b7eb").write_text("step_00000005\n")
    CheckpointStore(tmp_path).prepare()
    assert not list(tmp_path.glob(".tmp.*"))


# -- latest is read first -------------------------------------------------------------------


def test_latest_counts_even_when_the_listing_misses_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = CheckpointStore(tmp_path)
    store.prepare()
    save(store, 100)
    save(store, 200)
    events: list[str] = []
    real_iterdir = Path.iterdir
    real_pointer = CheckpointStore.latest_pointer

    def stale_listing(self: Path):
        if self == tmp_path:
            events.append("list")
            return (p for p in real_iterdir(self) if p.name != checkpoint_name(200))  # an NFS client's stale cache
        return real_iterdir(self)

    def pointer(self: CheckpointStore) -> str | None:
        events.append("latest")
        return real_pointer(self)

    monkeypatch.setattr(Path, "iterdir", stale_listing)
    monkeypatch.setattr(CheckpointStore, "latest_pointer", pointer)
    assert [c.step for c in store.committed()] == [200, 100]
    assert events.index("latest") < events.index("list")
    (newest, _) = store.committed()
    assert newest.path == tmp_path / checkpoint_name(200)
    store.verify(newest)


def test_latest_is_not_trusted_beyond_naming_a_committed_directory(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.prepare()
    save(store, 100)
    for text in ("step_00000300\n", "../outside\n", ".tmp.step_00000300.x\n", "garbage\n", "\n"):
        (tmp_path / LATEST).write_text(text)
        (tmp_path / ".tmp.step_00000300.x").mkdir(exist_ok=True)
        assert [c.step for c in store.committed()] == [100], text
    # The newest committed directory wins even when latest names an older one.
    save(store, 200)
    (tmp_path / LATEST).write_text(checkpoint_name(100) + "\n")
    assert [c.step for c in store.committed()] == [200, 100]


# -- replacing a committed step ---------------------------------------------------------------


class Crash(BaseException):
    """A process dying: nothing after it runs."""


def test_a_crash_between_the_two_renames_keeps_the_old_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = CheckpointStore(tmp_path)
    store.prepare(WriterIdentity.new("run-a"))
    save(store, 100, value=1.0)
    real_rename = os.rename
    renames: list[tuple[str, str]] = []

    def rename_then_die(src, dst) -> None:
        renames.append((Path(src).name, Path(dst).name))
        if len(renames) == 2:
            raise Crash  # after step_N -> step_N.replaced, before the new copy is renamed in
        real_rename(src, dst)

    monkeypatch.setattr(store_module.os, "rename", rename_then_die)
    with pytest.raises(Crash):
        save(store, 100, value=2.0)
    monkeypatch.setattr(store_module.os, "rename", real_rename)
    assert renames[0] == (checkpoint_name(100), checkpoint_name(100) + ".replaced")
    assert not (tmp_path / checkpoint_name(100)).exists()
    assert (tmp_path / (checkpoint_name(100) + ".replaced")).is_dir()

    # Before any restart, a reader still finds step 100 (the old copy) and it verifies.
    (found,) = store.committed()
    assert (found.name, found.step) == (checkpoint_name(100), 100)
    assert found.path.name == checkpoint_name(100) + ".replaced"
    store.verify(found)

    # The restarted job puts it back, and drops the half-made new copy.
    restarted = CheckpointStore(tmp_path)
    restarted.prepare(WriterIdentity.new("run-a"))
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [checkpoint_name(100)]
    assert [c.path.name for c in restarted.committed()] == [checkpoint_name(100)]
    assert torch.equal(weights(restarted, 100), torch.full((8, 4), 1.0))


def test_a_crash_after_the_second_rename_keeps_the_new_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = CheckpointStore(tmp_path)
    store.prepare()
    save(store, 100, value=1.0)
    real_rmtree = store_module.shutil.rmtree

    def die_on_removing_the_old_copy(path, *args, **kwargs) -> None:
        if Path(path).name.endswith(".replaced") and Path(path).exists():
            raise Crash
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(store_module.shutil, "rmtree", die_on_removing_the_old_copy)
    with pytest.raises(Crash):
        save(store, 100, value=2.0)
    monkeypatch.setattr(store_module.shutil, "rmtree", real_rmtree)
    assert (tmp_path / checkpoint_name(100)).is_dir() and (tmp_path / (checkpoint_name(100) + ".replaced")).is_dir()
    (found,) = store.committed()
    assert found.path.name == checkpoint_name(100)  # the new copy wins over the old one
    CheckpointStore(tmp_path).prepare()
    assert not (tmp_path / (checkpoint_name(100) + ".replaced")).exists()
    assert torch.equal(weights(store, 100), torch.full((8, 4), 2.0))


def test_replacing_a_step_leaves_only_the_new_copy(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.prepare()
    save(store, 100, value=1.0)
    save(store, 100, value=3.0)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [checkpoint_name(100)]
    assert torch.equal(weights(store, 100), torch.full((8, 4), 3.0))


# -- the writer claim -------------------------------------------------------------------------








def test_a_claim_from_another_host_lives_until_its_heartbeat_is_stale(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.prepare(claim_of("run-far", pid=1, host="elsewhere.invalid", heartbeat=time.time() - 60))
    leftovers(tmp_path)
    with pytest.raises(CheckpointStorageError, match="run run-far on elsewhere.invalid"):
        store.prepare(WriterIdentity.new("run-near"))
    assert (tmp_path / ".tmp.step_00000300.other").is_dir()

    stale = claim_of("run-far", pid=1, host="elsewhere.invalid", heartbeat=time.time() - 1801)
    replace_small(tmp_path, WRITER, stale.to_json())
    mine = WriterIdentity.new("run-near")
    store.prepare(mine)
    assert store.writer() == mine
    assert not (tmp_path / ".tmp.step_00000300.other").exists()


def test_a_restart_of_the_same_run_takes_over_from_its_previous_rank_0(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    previous = WriterIdentity.new("run-a")  # this very process: alive
    store.prepare(previous)
    successor = WriterIdentity.new("run-a")
    assert successor.writer != previous.writer
    store.prepare(successor)
    assert store.writer() == successor
    with pytest.raises(SaveFailed):
        store.check_owner(previous)


def test_the_same_run_s_old_rank_0_on_another_host_is_taken_over(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    elsewhere = claim_of("run-a", pid=4242, host="elsewhere.invalid")  # fresh heartbeat: maybe still running
    store.prepare(elsewhere)
    here = WriterIdentity.new("run-a")
    store.prepare(here)
    assert store.writer() == here
    with pytest.raises(SaveFailed, match="another writer"):
        store.check_owner(elsewhere)  # it is refused at its next commit






def test_an_unreadable_claim_is_taken_over(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.prepare()
    (tmp_path / WRITER).write_text("{not json")
    assert store.writer() is None
    mine = WriterIdentity.new("run-a")
    store.prepare(mine)
    assert store.writer() == mine
    assert WriterIdentity.from_json(mine.to_json()) == mine


# -- quarantine ------------------------------------------------------------------------------


def test_quarantine_keeps_the_newest_corrupt_checkpoints(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=5, keep_corrupt=2)
    store.prepare()
    for step in (100, 200, 300, 400):
        save(store, step)
    # A restore tries the newest first and moves each corrupt one aside in that order.
    moved = []
    for candidate in store.committed():
        target = store.quarantine(candidate)
        assert target.name == candidate.name + ".corrupt"
        assert target.is_dir(), f"{target.name} was deleted as soon as it was quarantined"
        moved.append(target.name)
        time.sleep(0.01)
    left = sorted(p.name for p in tmp_path.iterdir() if ".corrupt" in p.name)
    assert len(left) == 2
    assert left == sorted(moved[-2:])  # the two quarantined last
    assert store.committed() == []


def test_quarantining_the_same_step_again_keeps_both_copies_apart(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_corrupt=3)
    store.prepare()
    save(store, 100, value=1.0)
    (first,) = store.committed()
    store.quarantine(first)
    save(store, 100, value=2.0)
    (second,) = store.committed()
    target = store.quarantine(second)
    assert target.name.startswith(checkpoint_name(100) + ".corrupt.")
    assert len([p for p in tmp_path.iterdir() if ".corrupt" in p.name]) == 2
    assert store.committed() == []
