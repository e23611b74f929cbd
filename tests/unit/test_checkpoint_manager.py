"""The state manager in one process: round trip, fallback on corruption, mismatches."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
from support import checkpoints_fingerprint

from elastic._shared.common.errors import CheckpointError, CheckpointMismatchError
from elastic._shared.storage.manifest import versions
from elastic._worker.checkpoint import (
    CheckpointManager,
    CheckpointStore,
    Manifest,
    read_checkpoint,
)
from elastic._worker.config import RunConfig
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.observe.events import EventLog, read_events
from elastic._worker.runtime.context import init_worker


class Job:
    """A tiny model, optimizer, scheduler and sampler, trained step by step."""

    def __init__(self, ckpt_dir: Path, *, width: int = 8, samples: int = 40, events: Path | None = None) -> None:
        torch.manual_seed(0)
        self.ctx = init_worker("cpu", environ={})
        self.model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Dropout(0.2), torch.nn.Linear(width, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)
        self.sampler = ElasticSampler(samples, batch_size=4, seed=3)
        self.events = EventLog(events, restart=0)
        self.ckpt = CheckpointManager(
            self.ctx, RunConfig(ckpt_dir=ckpt_dir, ckpt_every=2, seed=3), model=self.model, optimizer=self.optimizer,
            sampler=self.sampler, scheduler=self.scheduler, events=self.events,
        )

    def train_step(self) -> None:
        x = torch.randn(4, 4)
        self.model(x).pow(2).mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        self.sampler.advance(1)

    def run(self, steps: int, start: int = 0) -> int:
        for step in range(start + 1, start + steps + 1):
            self.train_step()
            self.ckpt.maybe_save(step)
        self.ckpt.flush()
        return start + steps

    def close(self) -> None:
        self.ckpt.close()
        self.events.close()


def test_restore_continues_exactly_where_the_save_left_off(tmp_path: Path) -> None:
    first = Job(tmp_path / "ckpt", events=tmp_path / "events.jsonl")
    assert first.ckpt.restore() == 0
    first.run(6)
    expected_next = [first.model(torch.ones(1, 4)).item() for _ in range(2)]  # consumes dropout RNG
    first.close()

    second = Job(tmp_path / "ckpt", events=tmp_path / "events.jsonl")
    assert second.ckpt.restore() == 6
    assert second.sampler.state == first.sampler.state
    assert second.scheduler.state_dict() == first.scheduler.state_dict()
    for a, b in zip(second.model.parameters(), first.model.parameters()):
        assert torch.equal(a, b)
    assert [second.model(torch.ones(1, 4)).item() for _ in range(2)] == expected_next, "RNG restored"
    second.close()

    events = list(read_events(tmp_path / "events.jsonl"))
    saves = [e for e in events if e["event"] == "checkpoint"]
    assert [e["step"] for e in saves] == [2, 4, 6]
    assert all(e["seconds"] >= e["blocking_seconds"] >= 0 for e in saves)
    (restore,) = [e for e in events if e["event"] == "restore"]
    assert restore["step"] == 6 and restore["seconds"] >= 0


def test_a_save_holds_the_state_of_its_step_while_training_runs_on(tmp_path: Path) -> None:
    job = Job(tmp_path / "ckpt")
    job.run(1)
    job.ckpt.save(1)
    at_save = [p.detach().clone() for p in job.model.parameters()]
    for _ in range(3):  # optimizer steps right away: the hook holds each until the copy is done
        job.train_step()
    job.ckpt.flush()
    job.close()
    _, tensors, _ = read_checkpoint(tmp_path / "ckpt" / "step_00000001")
    names = [name for name, _ in job.model.named_parameters()]
    assert all(torch.equal(tensors[f"model/{name}"], b) for name, b in zip(names, at_save))


def shard(step_dir: Path) -> Path:
    (path,) = sorted(step_dir.glob("shard_*.bin"))  # one process: one shard file
    return path


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        flipped = bytearray(data)
        flipped[len(flipped) // 3] ^= 0xFF
        path.write_bytes(bytes(flipped))


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path: Path, how: str, caplog) -> None:
    job = Job(tmp_path / "ckpt")
    job.run(6)
    job.close()
    damage(shard(tmp_path / "ckpt" / "step_00000006"), how)  # truncated: its size; flipped: a chunk's crc32c

    again = Job(tmp_path / "ckpt")
    with caplog.at_level(logging.WARNING):
        assert again.ckpt.restore() == 4
    assert "step_00000006 is corrupt" in caplog.text
    assert (tmp_path / "ckpt" / "step_00000006.corrupt").is_dir(), "kept for a post-mortem, out of the way"
    again.run(2, start=4)
    again.close()
    assert (tmp_path / "ckpt" / "step_00000006").is_dir(), "the step is saved afresh"


def test_all_corrupt_is_an_error_and_nothing_is_moved(tmp_path: Path) -> None:
    job = Job(tmp_path / "ckpt")
    job.run(4)
    job.close()
    for step in (2, 4):
        damage(tmp_path / "ckpt" / f"step_{step:08d}" / "trainer.pt", "truncate")
    before = checkpoints_fingerprint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="no checkpoint in .* verifies"):
        Job(tmp_path / "ckpt").ckpt.restore()
    assert checkpoints_fingerprint(tmp_path / "ckpt") == before


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"width": 16}, r"0.weight has shape \[8, 4\] there and \[16, 4\] here"),
        ({"samples": 44}, "another data set or seed"),
    ],
)
def test_a_checkpoint_of_another_model_or_data_set_is_refused(tmp_path: Path, change: dict, message: str) -> None:
    job = Job(tmp_path / "ckpt")
    job.run(2)
    job.close()
    before = checkpoints_fingerprint(tmp_path / "ckpt")
    other = Job(tmp_path / "ckpt", **change)
    weights = [p.detach().clone() for p in other.model.parameters()]
    with pytest.raises(CheckpointMismatchError, match=message):
        other.ckpt.restore()
    assert checkpoints_fingerprint(tmp_path / "ckpt") == before
    assert all(torch.equal(a, b) for a, b in zip(other.model.parameters(), weights)), "nothing was loaded"


def test_a_format_1_checkpoint_of_an_older_release_still_restores(tmp_path: Path) -> None:
    """Releases before 0.3 wrote model.pt, optimizer.pt and trainer.pt from rank 0 (sha256s)."""
    from elastic._worker.runtime.rng import get_rng_state

    first = Job(tmp_path / "unused")
    first.run(5)
    first.close()
    trainer = {  # what the old manager wrote (it had no "optimizer" settings)
        "step": 5, "world_size": 1, "sampler": first.sampler.state_dict(),
        "scheduler": first.scheduler.state_dict(), "scaler": None, "extra": {},
        "rng": [get_rng_state(torch.device("cpu"))],
    }
    store = CheckpointStore(tmp_path / "ckpt")
    store.prepare()
    store.commit(
        5,
        {"model.pt": first.model.state_dict(), "optimizer.pt": first.optimizer.state_dict(), "trainer.pt": trainer},
        describe=lambda files: Manifest(
            step=5, epoch=int(trainer["sampler"]["epoch"]), consumed=int(trainer["sampler"]["consumed"]),
            world_size=1, files=files, created=0.0, reason="periodic", run_id="old", versions=versions(),
        ),
    )
    (old,) = store.committed()
    assert store.verify(old).format == 1
    assert set(store.read_manifest(old).files) == {"model.pt", "optimizer.pt", "trainer.pt"}
    expected_next = [first.model(torch.ones(1, 4)).item() for _ in range(2)]  # consumes dropout RNG

    second = Job(tmp_path / "ckpt")
    assert second.ckpt.restore() == 5
    assert second.sampler.state == first.sampler.state
    assert second.scheduler.state_dict() == first.scheduler.state_dict()
    for a, b in zip(second.model.parameters(), first.model.parameters()):
        assert torch.equal(a, b)
    theirs, ours = first.optimizer.state_dict(), second.optimizer.state_dict()
    assert theirs["param_groups"] == ours["param_groups"]
    assert theirs["state"].keys() == ours["state"].keys()
    for index, state in theirs["state"].items():
        for name, value in state.items():
            assert torch.equal(ours["state"][index][name], value), f"optimizer state {name} of parameter {index}"
    assert [second.model(torch.ones(1, 4)).item() for _ in range(2)] == expected_next, "RNG restored"

    # Training goes on from it and the next save is in the current format, which restores in turn.
    second.run(1, start=5)
    second.ckpt.save(6, reason="final")
    second.ckpt.flush()
    second.close()
    manifest, tensors, _ = read_checkpoint(tmp_path / "ckpt" / "step_00000006")
    assert manifest.format == 2 and "model/0.weight" in tensors and "optim/0.weight/exp_avg" in tensors
    third = Job(tmp_path / "ckpt")
    assert third.ckpt.restore() == 6
    for a, b in zip(third.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)
    third.close()


def test_a_save_whose_group_broke_is_one_warning_when_the_manager_is_left_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A heal in place drops the manager of the broken group (`close(wait=0)`) while a save is in flight,
    and an error on the way out closes it again: the save's error (a collective that met the dead peer)
    is one warning, never an exception out of either close, and nothing is committed."""
    import elastic._worker.checkpoint.saver as saver_module

    job = Job(tmp_path / "ckpt")
    job.ckpt.restore()
    job.run(1)

    def broken_group(*args: object, **kwargs: object) -> bool:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")

    monkeypatch.setattr(saver_module.agreement, "all_ok", broken_group)
    job.train_step()
    job.ckpt.save(2)
    # The save has met the broken group by the time the heal drops the manager (what the heal waits
    # for); on a loaded machine the writer thread may not have got there yet otherwise, and the
    # first close would abandon a save still in flight (one warning too, a timeout's).
    deadline = time.monotonic() + 30
    while job.ckpt.saver._writer.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    with caplog.at_level(logging.WARNING):
        job.ckpt.close(wait=0.0)
        job.ckpt.close(wait=5.0)
    assert sum("did not commit: Connection closed by peer" in r.getMessage() for r in caplog.records) == 1
    assert [c.step for c in CheckpointStore(tmp_path / "ckpt").committed()] == [], "nothing committed"
    job.events.close()


def test_a_distributed_job_without_a_directory_says_in_one_line_what_it_gives_up(caplog) -> None:
    """Without --ckpt-dir a failure restarts training from step 0 (no checkpoints, no snapshots): rank 0 of a
    job under torchrun says so at start; a plain process (nothing restarts it) and the other ranks do not."""
    from elastic._worker.checkpoint.manager import NO_CHECKPOINTS
    from elastic._worker.runtime.context import WorkerContext

    def restore_at(rank: int, world_size: int, backend: str | None = "gloo") -> list[str]:
        caplog.clear()
        ctx = WorkerContext(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size,
                            restart_count=0, run_id="t", device=torch.device("cpu"), backend=backend)
        model = torch.nn.Linear(2, 1)
        manager = CheckpointManager(ctx, RunConfig(), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                    sampler=ElasticSampler(8, batch_size=2))
        with caplog.at_level(logging.WARNING):
            assert manager.restore() == 0
        manager.close()
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    assert restore_at(0, 2) == [NO_CHECKPOINTS] and "\n" not in NO_CHECKPOINTS
    assert restore_at(1, 2) == [] and restore_at(0, 1, backend=None) == []
