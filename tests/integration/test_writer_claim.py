"""The writer claim against real processes: a live one's directory is refused, a dead one's taken over,
and a writer that lost the directory commits nothing there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from store_helpers import claim_of, leftovers, save

from elastic._shared.common.errors import CheckpointStorageError
from elastic._shared.storage.claim import WRITER, WriterIdentity
from elastic._shared.storage.directory import CheckpointStore
from elastic._shared.storage.durable import SaveFailed
from elastic._shared.storage.manifest import checkpoint_name


def live_pid() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_second_job_is_refused_while_the_first_one_lives(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    other = live_pid()
    try:
        first = claim_of("run-other", pid=other.pid)
        store.prepare(first)
        save(store, 100, owner=first)
        leftovers(tmp_path)
        before = (tmp_path / WRITER).read_text()

        with pytest.raises(CheckpointStorageError) as caught:
            CheckpointStore(tmp_path).prepare(WriterIdentity.new("run-mine"))
        message = str(caught.value)
        assert "\n" not in message
        assert "written by another job" in message and "run-other" in message and str(other.pid) in message
        assert "--ckpt-dir" in message
        # Nothing of the other job's was touched: its claim, its save in progress, its checkpoints.
        assert (tmp_path / WRITER).read_text() == before
        assert (tmp_path / ".tmp.step_00000300.other" / "shard_00000.bin").read_bytes() == b"half written"
        assert [c.step for c in store.committed()] == [100]
    finally:
        other.kill()
        other.wait()

    # Once that process is gone, the directory is taken over and its leftovers removed.
    mine = WriterIdentity.new("run-mine")
    CheckpointStore(tmp_path).prepare(mine)
    assert CheckpointStore(tmp_path).writer() == mine
    assert not list(tmp_path.glob(".tmp.*"))
    assert [c.step for c in store.committed()] == [100]


def test_a_claim_by_a_dead_process_is_taken_over(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.prepare(claim_of("run-old", pid=dead_pid()))
    leftovers(tmp_path)
    mine = WriterIdentity.new("run-new")
    store.prepare(mine)
    assert store.writer() == mine
    assert not list(tmp_path.glob(".tmp.*"))


def test_another_live_process_of_the_same_run_id_on_this_host_is_refused(tmp_path: Path) -> None:
    # Two single-process runs share the run id "local": the directory is still one job's.
    store = CheckpointStore(tmp_path)
    other = live_pid()
    try:
        store.prepare(claim_of("local", pid=other.pid))
        with pytest.raises(CheckpointStorageError, match="written by another job"):
            store.prepare(WriterIdentity.new("local"))
    finally:
        other.kill()
        other.wait()


def test_a_writer_that_lost_the_directory_does_not_commit(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    old = claim_of("run-old", pid=dead_pid())
    store.prepare(old)
    save(store, 100, owner=old)
    store.check_owner(old)
    store.heartbeat(old)
    assert store.writer().heartbeat >= old.heartbeat

    new = WriterIdentity.new("run-new")
    CheckpointStore(tmp_path).prepare(new)
    theirs = leftovers(tmp_path)
    with pytest.raises(SaveFailed) as caught:
        store.check_owner(old)
    assert "\n" not in str(caught.value) and "run-new" in str(caught.value)
    with pytest.raises(SaveFailed):
        store.heartbeat(old)
    assert store.writer() == new

    # A save the old writer finishes now is refused; its own temporary goes, the new writer's stays.
    with pytest.raises(SaveFailed, match="another writer"):
        save(store, 200, owner=old)
    assert [c.step for c in store.committed()] == [100]
    assert [p.name.encode() for p in tmp_path.glob(".tmp.*")] == [theirs["dir"]]
    assert store.latest_pointer() == checkpoint_name(100)
    # The new writer commits, and its commit refreshes its claim.
    save(store, 200, owner=new)
    assert store.writer().writer == new.writer and store.writer().heartbeat >= new.heartbeat
