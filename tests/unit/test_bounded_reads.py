"""Reads of files anyone on the node could have put in the way: links not followed, FIFOs and
devices refused without a wait, nothing read past a file's size (storage/validate.py)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from elastic._agent.launcher.keeper_receive import ReplicaReceiver
from elastic._agent.launcher.keeper_endpoint import Conflict
from elastic._shared.common.errors import CorruptCheckpoint
from elastic._shared.storage import validate
from elastic._shared.storage.chunks import MappedFiles
from elastic._shared.storage.keeper_address import JOB_FILE
from elastic._worker.checkpoint import part_files


def test_a_symbolic_link_is_not_followed_unless_the_caller_laid_it_out(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b'{"a": 1}')
    (tmp_path / "link").symlink_to(elsewhere)
    with pytest.raises(CorruptCheckpoint, match="symbolic link"):
        validate.read_bounded(tmp_path / "link", "link", 100)
    with pytest.raises(CorruptCheckpoint, match="symbolic link"):
        validate.regular_size(tmp_path / "link", "link")
    with pytest.raises(CorruptCheckpoint, match="symbolic link"):
        MappedFiles(tmp_path).view("link", 0, 1)
    # A restore's own layout (links to this node's parts) is followed.
    assert bytes(MappedFiles(tmp_path, follow_links=True).view("link", 0, 4)) == b'{"a"'
    with validate.open_regular(tmp_path / "link", "link", follow_link=True) as f:
        assert f.read() == b'{"a": 1}'


def test_a_local_part_span_is_read_only_from_a_regular_file_and_within_its_size(tmp_path: Path) -> None:
    part = tmp_path / "part"
    part.write_bytes(bytes(range(10)))
    (tmp_path / "mine").symlink_to(part)
    assert part_files._read_span(tmp_path / "mine", 2, 5) == bytearray(b"\x02\x03\x04")
    assert part_files._read_span(tmp_path / "mine", 5, 2**40) is None  # never an allocation past the file
    (tmp_path / "zeros").symlink_to("/dev/zero")  # reads forever, never short
    with pytest.raises(CorruptCheckpoint, match="not a regular file"):
        part_files._read_span(tmp_path / "zeros", 0, 4)
    os.mkfifo(tmp_path / "fifo")  # a plain open would wait for a writer forever
    with pytest.raises(CorruptCheckpoint, match="not a regular file"):
        part_files._read_span(tmp_path / "fifo", 0, 4)


def _keeper_checks(root: Path) -> str:
    """What the keeper says of a replica of run r, generation g, world size 2, given `root`'s job.json."""
    receiver = SimpleNamespace(_root=root, _run_id="r")
    header = SimpleNamespace(run_id="r", extra={"generation": "g"}, world_size=2)
    try:
        ReplicaReceiver._check_job(receiver, header)  # type: ignore[arg-type]
    except Conflict as exc:
        return str(exc)
    return "kept"


def test_a_keepers_job_json_is_read_bounded(tmp_path: Path) -> None:
    job = tmp_path / JOB_FILE
    job.write_text('{"generation": "g", "world_size": 2}')
    assert _keeper_checks(tmp_path) == "kept"
    job.write_text(" " * (2**20) + '{"generation": "g", "world_size": 2}')  # far more than a job.json holds
    assert "not started a generation" in _keeper_checks(tmp_path)
    job.unlink()
    os.mkfifo(job)
    answer: list[str] = []
    checking = threading.Thread(target=lambda: answer.append(_keeper_checks(tmp_path)), daemon=True)
    checking.start()
    checking.join(30)
    if checking.is_alive():  # the keeper waits on the FIFO: let it go, then fail
        with open(job, "wb"):
            pass
        checking.join(30)
        pytest.fail("the keeper waited on a FIFO put in place of job.json")
    assert "not started a generation" in answer[0]
