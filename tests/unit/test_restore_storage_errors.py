"""A storage error at any step of a restore (claim, list, verify, read) is one
`CheckpointStorageError` line, and every rank takes the same outcome of a read
(elastic/_worker/checkpoint/planner.py, loader.py, directory_claim.py)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from elastic._shared.common.errors import (
    CheckpointError,
    CheckpointStorageError,
    CorruptCheckpoint,
    RestoreTimedOut,
)
from elastic._shared.storage import claim as claims
from elastic._shared.storage import sharded
from elastic._shared.storage.directory import CheckpointStore
from elastic._worker.checkpoint import CheckpointManager
from elastic._worker.checkpoint import loader as loader_module
from elastic._worker.checkpoint.sources import Offer
from elastic._worker.config import RunConfig
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.runtime.context import init_worker


def manager(ckpt: Path) -> CheckpointManager:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return CheckpointManager(
        init_worker("cpu", environ={}), RunConfig(ckpt_dir=ckpt, ckpt_every=2), model=model, optimizer=optimizer,
        sampler=ElasticSampler(40, batch_size=4, seed=3),
    )


def saved(ckpt: Path) -> None:
    first = manager(ckpt)
    assert first.restore() == 0
    first.save(2, reason="final")
    first.flush()
    first.close()


def failing(code: int):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code), "injected")

    return fail


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EIO])
def test_writing_the_claim_fails_as_one_storage_error(tmp_path: Path, monkeypatch, code: int) -> None:
    monkeypatch.setattr(claims, "replace_small", failing(code))
    ckpt = manager(tmp_path / "ckpt")
    with pytest.raises(CheckpointStorageError) as caught:
        ckpt.restore()
    ckpt.close()
    assert one_line(caught.value).startswith(f"cannot claim checkpoint directory {tmp_path / 'ckpt'}: {os.strerror(code)}")
    assert caught.value.exit_code == 75


def test_listing_the_directory_fails_as_one_storage_error(tmp_path: Path, monkeypatch) -> None:
    saved(tmp_path / "ckpt")
    monkeypatch.setattr(CheckpointStore, "committed", failing(errno.EIO))
    ckpt = manager(tmp_path / "ckpt")
    with pytest.raises(CheckpointStorageError, match=r"^cannot list .*: Input/output error \(EIO\)"):
        ckpt.restore()
    ckpt.close()


def test_verifying_on_rank_0_fails_as_one_storage_error(tmp_path: Path, monkeypatch) -> None:
    saved(tmp_path / "ckpt")
    monkeypatch.setattr(CheckpointStore, "read_file", failing(errno.EIO))
    ckpt = manager(tmp_path / "ckpt")
    with pytest.raises(CheckpointStorageError, match=r"^cannot read checkpoints in .*: Input/output error"):
        ckpt.restore()
    ckpt.close()


def test_reading_the_tensors_fails_as_one_storage_error_and_nothing_changes(tmp_path: Path, monkeypatch) -> None:
    saved(tmp_path / "ckpt")
    monkeypatch.setattr(sharded, "load_tensors", failing(errno.EIO))
    ckpt = manager(tmp_path / "ckpt")
    before = {k: v.clone() for k, v in ckpt.state.model.state_dict().items()}
    with pytest.raises(CheckpointStorageError, match=r"^cannot read step_00000002 in .*Input/output error \(EIO\)"):
        ckpt.restore()
    ckpt.close()
    after = ckpt.state.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


# -- every rank takes the same outcome -------------------------------------------------------------


def ranks_raise(monkeypatch, errors: list[Exception | None]) -> list[tuple[type, str] | None]:
    """What each rank of a job raises when rank r met errors[r] reading (the gather's answer is every rank's)."""
    offer = Offer(source="disk", name="step_00000002", checkpoint="step_00000002", manifest="{}", trainer={}, tensors_json=None)
    outcomes = [loader_module._Outcome.of(e, "cannot read step_00000002") for e in errors]
    monkeypatch.setattr(loader_module.agreement, "all_gather", lambda ctx, message, kind, group=None: outcomes)
    loader = loader_module.Loader(init_worker("cpu", environ={}), None, CheckpointStore("."), group=None, restore_timeout=1)
    raised = []
    for error in errors:
        try:
            loader._agree(offer, error)
            raised.append(None)
        except Exception as exc:  # noqa: BLE001 - what each rank raises is the point
            raised.append((type(exc), str(exc)))
    return raised


def test_ranks_either_side_of_the_deadline_all_stop_with_the_same_line(monkeypatch) -> None:
    late = RestoreTimedOut("restoring step_00000002 from ckpt did not finish within 2 s (--ckpt-restore-timeout)")
    raised = ranks_raise(monkeypatch, [None, late, None])
    assert raised == [(RestoreTimedOut, str(late))] * 3
    # A rank that gave up on its clock and one that met a storage error: still one outcome, the timeout.
    eio = CheckpointStorageError("cannot read step_00000002 in ckpt: Input/output error (EIO)")
    assert ranks_raise(monkeypatch, [eio, late]) == [(RestoreTimedOut, str(late))] * 2


def test_one_rank_s_storage_error_or_corrupt_chunk_is_every_rank_s(monkeypatch) -> None:
    eio = OSError(errno.EIO, os.strerror(errno.EIO), "shard_00001.bin")
    line = "cannot read step_00000002: Input/output error (EIO): shard_00001.bin"
    assert ranks_raise(monkeypatch, [None, eio]) == [(CheckpointStorageError, line)] * 2
    corrupt = CorruptCheckpoint("step_00000002/shard_00000.bin: a chunk fails its crc32c check")
    assert ranks_raise(monkeypatch, [corrupt, None]) == [(CorruptCheckpoint, str(corrupt))] * 2
    assert ranks_raise(monkeypatch, [corrupt, eio]) == [(CheckpointStorageError, line)] * 2
    assert ranks_raise(monkeypatch, [None, None]) == [None, None]


def test_an_unexpected_failure_is_raised_as_itself_and_elsewhere_as_a_checkpoint_error(monkeypatch) -> None:
    bug = RuntimeError("connection reset by peer")
    raised = ranks_raise(monkeypatch, [None, bug])
    assert raised[1] == (RuntimeError, "connection reset by peer")
    assert raised[0] == (CheckpointError, "another rank failed reading the checkpoint: RuntimeError: connection reset by peer")
