"""Faults of the storage in one process: a failed save is a warning, not a crash;
failures in a row, a failed final save or a hung one stop with one line; a restart
on storage that cannot take a checkpoint stops before training."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from store_helpers import describe, temporaries

from elastic._shared.common.errors import CheckpointStorageError, UsageError
from elastic._shared.storage import directory as store_module
from elastic._shared.storage.directory import CheckpointStore
from elastic._worker.checkpoint import CheckpointManager
from elastic._worker.config import RunConfig
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.observe.events import EventLog, read_events
from elastic._worker.runtime.context import init_worker
from elastic.chaos.faults import FaultInjector, parse_faults


class Job:
    """A tiny model trained step by step, saving every 2 steps."""

    def __init__(
        self, ckpt_dir: Path, events: Path, *, max_failures: int = 3, timeout: float = 600.0, wait_slice: float = 5.0,
    ) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 2)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.sampler = ElasticSampler(40, batch_size=4, seed=3)
        self.events = EventLog(events, restart=0)
        config = RunConfig(
            ckpt_dir=ckpt_dir, ckpt_every=2, ckpt_max_failures=max_failures, ckpt_timeout=timeout,
            collective_timeout=4 * wait_slice,  # waits for storage come in slices of a quarter of it
        )
        self.ckpt = CheckpointManager(
            init_worker("cpu", environ=dict(os.environ)), config, model=self.model, optimizer=self.optimizer, sampler=self.sampler,
            events=self.events,
        )
        self.step = 0

    def train(self, steps: int, *, settle: bool = True) -> None:
        """`steps` steps; with `settle`, each save commits (or fails) before the next step."""
        for _ in range(steps):
            self.model(torch.randn(4, 4)).pow(2).mean().backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.sampler.advance(1)
            self.step += 1
            self.ckpt.maybe_save(self.step)
            if settle and self.ckpt.due(self.step):
                self.ckpt.saver.collect(block=True)  # the save's outcome, as the next interval would see it

    def close(self) -> None:
        self.ckpt.close()
        self.events.close()


def recorded(events: Path, kind: str) -> list[dict]:
    return [e for e in read_events(events) if e["event"] == kind]


def test_a_failed_save_is_a_warning_and_training_goes_on(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("ELASTIC_FAULT", "during_write@4:do=enospc")
    job = Job(tmp_path / "ckpt", tmp_path / "events.jsonl")
    assert job.ckpt.restore() == 0
    with caplog.at_level(logging.WARNING):
        job.train(6)
    assert "checkpoint of step 4 failed (1 of 3 in a row" in caplog.text
    assert "No space left on device (ENOSPC)" in caplog.text
    assert not job.ckpt.must_stop
    job.ckpt.flush()
    job.close()

    (failed,) = recorded(tmp_path / "events.jsonl", "checkpoint_failed")
    assert failed["step"] == 4 and failed["failures_in_a_row"] == 1 and "ENOSPC" in failed["error"]
    assert [e["step"] for e in recorded(tmp_path / "events.jsonl", "checkpoint")] == [2, 6]
    assert temporaries(tmp_path / "ckpt") == [], "the failed save's temporary directory is removed"
    again = Job(tmp_path / "ckpt", tmp_path / "events.jsonl")
    assert again.ckpt.restore() == 6
    again.close()


def test_failures_in_a_row_stop_the_job_and_keep_the_last_good_checkpoint(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ELASTIC_FAULT", "during_write@4+:do=enospc")
    job = Job(tmp_path / "ckpt", tmp_path / "events.jsonl", max_failures=2)
    job.ckpt.restore()
    job.train(4)
    assert not job.ckpt.must_stop, "one failure is not yet a stop"
    job.train(2)
    assert job.ckpt.must_stop
    reason = job.ckpt.share_stop_reason()
    assert reason.startswith("2 checkpoints in a row failed (--ckpt-max-failures), the last: cannot write step_00000006")
    assert "step_00000002, is intact" in reason
    job.close()
    store = CheckpointStore(tmp_path / "ckpt")
    assert [c.step for c in store.committed()] == [2]
    store.verify(store.committed()[0])
    assert temporaries(tmp_path / "ckpt") == []


def test_a_commit_resets_the_count_of_failures_in_a_row(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ELASTIC_FAULT", "during_write@2:do=enospc,during_write@6:do=enospc")
    job = Job(tmp_path / "ckpt", tmp_path / "events.jsonl", max_failures=2)
    job.ckpt.restore()
    job.train(6)  # fails at 2, commits 4, fails at 6: never two in a row
    assert not job.ckpt.must_stop
    job.close()
    assert [e["failures_in_a_row"] for e in recorded(tmp_path / "events.jsonl", "checkpoint_failed")] == [1, 1]


def test_a_failed_final_save_stops_with_exit_75(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ELASTIC_FAULT", "during_write@3:do=enospc")
    job = Job(tmp_path / "ckpt", tmp_path / "events.jsonl")
    job.ckpt.restore()
    job.train(3)
    job.ckpt.save(3, reason="final")
    with pytest.raises(CheckpointStorageError) as caught:
        job.ckpt.flush()
    assert caught.value.exit_code == 75
    message = str(caught.value)
    assert message.startswith("the final checkpoint of step 3 failed: cannot write step_00000003")
    assert "\n" not in message and "step_00000002, is intact" in message
    job.close()


def test_a_hung_final_save_stops_within_the_timeout(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ELASTIC_FAULT", "during_write@2:do=slow:for=4")
    job = Job(tmp_path / "ckpt", tmp_path / "events.jsonl", timeout=0.5, wait_slice=0.1)
    job.ckpt.restore()
    job.train(1)
    job.ckpt.save(1, reason="final")  # commits at once
    job.ckpt.flush()
    job.train(1, settle=False)  # step 2's save stalls 4 s in the writer
    with pytest.raises(CheckpointStorageError, match=r"the periodic checkpoint of step 2 did not commit within 0.5 s"):
        job.ckpt.save(3, reason="preemption")  # waits for the one in flight first, within the timeout
    job.ckpt.saver.collect(block=True)  # let the stalled save end before the directory goes
    job.close()


def test_a_final_save_at_the_step_of_a_failed_periodic_one_is_written(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ELASTIC_FAULT", "during_write@4:do=enospc")
    job = Job(tmp_path / "ckpt", tmp_path / "events.jsonl")
    job.ckpt.restore()
    job.train(4)  # step 4's periodic save fails
    job.ckpt.faults = FaultInjector(0, 0, environ={})  # the disk has room again
    job.ckpt.save(4, reason="final")
    job.ckpt.flush()
    job.close()
    assert [(e["step"], e["reason"]) for e in recorded(tmp_path / "events.jsonl", "checkpoint")] == [
        (2, "periodic"), (4, "final"),
    ]


def test_a_periodic_save_due_while_one_is_writing_is_skipped(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ELASTIC_FAULT", "during_write@2:do=slow:for=1.5")
    job = Job(tmp_path / "ckpt", tmp_path / "events.jsonl", wait_slice=0.05)
    job.ckpt.restore()
    job.train(6, settle=False)  # 4 and 6 come due while 2 is still being written
    job.ckpt.flush()
    job.close()
    skipped = recorded(tmp_path / "events.jsonl", "checkpoint_skipped")
    assert [(e["step"], e["writing"]) for e in skipped] == [(4, 2), (6, 2)]
    assert [e["step"] for e in recorded(tmp_path / "events.jsonl", "checkpoint")] == [2]


def test_restore_stops_on_storage_without_room_for_a_checkpoint(tmp_path: Path, monkeypatch) -> None:
    job = Job(tmp_path / "ckpt", tmp_path / "events.jsonl")
    job.ckpt.restore()
    job.train(2)
    job.close()
    monkeypatch.setattr(store_module.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 100, 100))
    again = Job(tmp_path / "ckpt", tmp_path / "events.jsonl")
    with pytest.raises(CheckpointStorageError, match=r"has 0.0 MB free, a checkpoint takes .* MB: free space"):
        again.ckpt.restore()
    again.close()
    assert [c.step for c in CheckpointStore(tmp_path / "ckpt").committed()] == [2], "nothing saved was touched"


def test_restore_stops_on_storage_that_refuses_writes(tmp_path: Path, monkeypatch) -> None:
    real_open = open

    def failing_open(path, mode="r", *args, **kwargs):
        if "w" in mode and ".tmp.probe" in str(path):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(store_module, "open", failing_open, raising=False)
    job = Job(tmp_path / "ckpt", tmp_path / "events.jsonl")
    with pytest.raises(CheckpointStorageError, match=r"refuses writes: Input/output error \(EIO\)"):
        job.ckpt.restore()
    job.close()
    assert temporaries(tmp_path / "ckpt") == []


def test_a_directory_fsync_the_filesystem_refuses_is_skipped(tmp_path: Path, monkeypatch, caplog) -> None:
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        real_fsync(fd)

    monkeypatch.setattr(store_module.os, "fsync", fsync)
    store = CheckpointStore(tmp_path / "ckpt")
    store.prepare()
    with caplog.at_level(logging.WARNING):
        store.commit(1, {"model.pt": {"w": torch.ones(3)}}, describe=describe(1))
    assert store.verify(store.committed()[0]).step == 1








def test_an_event_log_that_cannot_be_created_or_written_is_one_line_or_a_warning(tmp_path: Path, caplog) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match=r"--events .*/file/events.jsonl: cannot create the event log"):
        EventLog(tmp_path / "file" / "events.jsonl", restart=0)
    log = EventLog("/dev/full", restart=0)  # every write: ENOSPC
    with caplog.at_level(logging.WARNING):
        log.emit("step", step=1, world_size=1)  # buffered (events.FLUSH_SECONDS) ...
        log.emit("eval", step=1, world_size=1)  # ... written with this one: the first failed write
        log.emit("step", step=2, world_size=1)
        log.close()
    assert caplog.text.count("no more events are written") == 1
    assert not log.enabled


def test_storage_faults_parse() -> None:
    (slow, full) = parse_faults("during_write@20:do=slow:for=2.5,during_write@30+:do=enospc:restart=any")
    assert (slow.action, slow.seconds, slow.matches("during_write", 20), slow.matches("during_write", 21)) == (
        "slow", 2.5, True, False,
    )
    assert (full.action, full.restart, full.matches("during_write", 29), full.matches("during_write", 90)) == (
        "enospc", None, False, True,
    )
    with pytest.raises(UsageError, match="for=SECONDS"):
        parse_faults("during_write@2:for=soon")
    with pytest.raises(UsageError, match="world=N"):
        parse_faults("after_step@2:world=0")
    with pytest.raises(UsageError, match="do=hold goes with until=FILE"):
        parse_faults("after_step@2:do=hold")


def test_a_hold_lasts_until_its_file_exists(tmp_path: Path) -> None:
    import threading

    go = tmp_path / "go"
    injector = FaultInjector(0, 0, environ={"ELASTIC_FAULT": f"after_step@3:do=hold:until={go}"})
    held = threading.Thread(target=injector.at, args=("after_step", 3))
    held.start()
    held.join(0.3)
    assert held.is_alive(), "it went on before the file existed"
    assert (tmp_path / "go.held").exists(), "it said it holds"
    go.touch()
    held.join(10)
    assert not held.is_alive()


def test_a_fault_for_one_world_size_fires_only_in_workers_started_at_it() -> None:
    paced = "after_step@1+:do=slow:for=0:restart=any:world=1"
    alone = FaultInjector(0, 3, environ={"ELASTIC_FAULT": paced, "WORLD_SIZE": "1"})
    together = FaultInjector(0, 3, environ={"ELASTIC_FAULT": paced, "WORLD_SIZE": "2"})
    unknown = FaultInjector(0, 0, environ={"ELASTIC_FAULT": paced})
    assert [f.world_size for f in alone._faults] == [1]
    assert together._faults == [] and unknown._faults == []


def test_a_fault_marked_once_fires_in_the_first_worker_that_reaches_it_only(tmp_path: Path) -> None:
    """Two workers and two attempts reach step 20 or later: the first one there fires it, no one else."""
    env = {"ELASTIC_FAULT": "after_step@20+:do=slow:for=0:restart=any:once", "ELASTIC_FAULT_ONCE_DIR": str(tmp_path)}
    first, second = FaultInjector(0, 0, environ=env), FaultInjector(0, 1, environ=env)
    fired = []
    for injector, step in ((first, 19), (second, 21), (first, 22), (second, 23)):
        before = len(list(tmp_path.iterdir()))
        injector.at("after_step", step)
        fired.append(len(list(tmp_path.iterdir())) > before)
    assert fired == [False, True, False, False]
    with pytest.raises(UsageError, match="ELASTIC_FAULT_ONCE_DIR"):
        FaultInjector(0, 0, environ={"ELASTIC_FAULT": "after_step@3:once"})


def test_without_a_checkpoint_directory_nothing_is_claimed_or_written(tmp_path: Path, monkeypatch) -> None:
    """No --ckpt-dir: no claim on any directory (a heal in place under train-on once wrote the claim's
    writer.json into the working directory)."""
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(4, 2)
    manager = CheckpointManager(
        init_worker("cpu", environ=dict(os.environ)), RunConfig(ckpt_dir=None), model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), sampler=ElasticSampler(8, batch_size=4, seed=0),
    )
    assert not manager.enabled and manager.claim is None
    manager.close(ended=True)
    assert list(tmp_path.iterdir()) == [], "nothing written where the worker runs"
