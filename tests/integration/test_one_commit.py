"""Rank 0 and a snapshot keeper commit through one function, and publishing the same step together is no failure.

The keeper (in the agent) persists the newest in-memory snapshot when the
workers stop; rank 0 commits its final save. Both go through
`elastic._shared.storage.commit.commit_checkpoint`, so both honour the claim, and the
one whose rename finds the step already there verifies that copy and discards
its own (it used to fail with ENOTEMPTY, and a final save that failed stopped the job).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from elastic._agent.launcher.keeper import SnapshotKeeper
from elastic._shared.storage import commit, directory
from elastic._shared.storage.claim import WriterIdentity
from elastic._shared.storage.directory import CheckpointStore
from elastic._shared.storage.manifest import checkpoint_name
from elastic._worker.checkpoint import CheckpointManager
from elastic._worker.config import RunConfig
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.observe.events import EventLog, read_events
from elastic._worker.runtime.context import init_worker


def train(tmp_path: Path, steps: int) -> tuple[CheckpointManager, EventLog]:
    """A one-process job with a snapshot at every step and no periodic checkpoint."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    sampler = ElasticSampler(64, batch_size=4, seed=3)
    events = EventLog(tmp_path / "events.jsonl", restart=0)
    ckpt = CheckpointManager(
        init_worker("cpu", environ=dict(os.environ)), RunConfig(ckpt_dir=tmp_path / "ckpt", ckpt_every=0, snapshot_every=1),
        model=model, optimizer=optimizer, sampler=sampler, events=events,
    )
    assert ckpt.restore() == 0
    for step in range(1, steps + 1):
        model(torch.randn(4, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        sampler.advance(1)
        ckpt.maybe_save(step)
    assert ckpt.memory is not None
    ckpt.memory.wait_previous()
    return ckpt, events


def renames_meet(monkeypatch: pytest.MonkeyPatch, name: str) -> list[str]:
    """Make the two writers of `name` rename their stages into it at the same moment; the
    sources of those renames, in the order they happened."""
    together = threading.Barrier(2, timeout=60)
    real_rename = os.rename
    order: list[str] = []

    def rename(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if Path(dst).name == name and not Path(src).name.endswith(".replaced"):
            together.wait()
            order.append(Path(src).name)
        real_rename(src, dst)

    monkeypatch.setattr(directory.os, "rename", rename)
    return order


def test_the_keeper_and_rank_0_publish_the_same_step_through_one_commit(
    tmp_path: Path, keeper: SnapshotKeeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt, events = train(tmp_path, 6)
    calls: list[str] = []
    one_commit = commit.commit_checkpoint

    def counted(store: CheckpointStore, stage: Path, **kwargs):  # type: ignore[no-untyped-def]
        calls.append("rank 0" if kwargs.get("owner") is not None else "keeper")
        return one_commit(store, stage, **kwargs)

    monkeypatch.setattr(commit, "commit_checkpoint", counted)
    monkeypatch.setattr("elastic._worker.checkpoint.saver.commit_checkpoint", counted)
    monkeypatch.setattr("elastic._agent.launcher.keeper_directory.commit_checkpoint", counted)
    order = renames_meet(monkeypatch, checkpoint_name(6))

    persisted: list[int] = []
    persist = threading.Thread(target=lambda: persisted.extend(keeper.persist()))
    persist.start()
    ckpt.save(6, reason="final")
    ckpt.flush()  # raises if the final save did not commit
    persist.join(60)
    ckpt.close()
    events.close()

    assert sorted(calls) == ["keeper", "rank 0"]
    assert len(order) == 2, "both writers reached the rename"
    assert persisted == [6]
    store = CheckpointStore(tmp_path / "ckpt")
    (committed,) = store.committed()
    assert committed.step == 6 and store.verify(committed).step == 6
    leftovers = [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".") and p.is_dir()]
    assert leftovers == [], "the copy that lost the race is gone"
    kinds = [e["event"] for e in read_events(tmp_path / "events.jsonl")]
    assert "checkpoint" in kinds and "checkpoint_failed" not in kinds


def test_a_keeper_commits_nothing_into_a_directory_another_job_took(
    tmp_path: Path, keeper: SnapshotKeeper
) -> None:
    ckpt, events = train(tmp_path, 4)
    ckpt.close()
    events.close()
    other = WriterIdentity.new("another-job")
    CheckpointStore(tmp_path / "ckpt").claim(other)  # that job is alive (this very process)
    assert keeper.persist() == []
    assert CheckpointStore(tmp_path / "ckpt").committed() == []
