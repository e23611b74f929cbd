"""The writer claim names a process by what survives pid reuse (boot id, pid namespace, pid, start
time) and a job by its run id; writer.json is untrusted input (elastic/_shared/storage/claim.py)."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest

from elastic._shared.common.errors import CheckpointStorageError
from elastic._shared.storage import claim as claims
from elastic._shared.storage.claim import WRITER, WriterIdentity
from elastic._shared.storage.directory import CheckpointStore
from elastic._shared.storage.durable import replace_small


def written(root: Path, identity: WriterIdentity) -> None:
    replace_small(root, WRITER, identity.to_json())


def test_a_writer_is_named_by_boot_id_pid_namespace_pid_and_start_time() -> None:
    me = WriterIdentity.new("run-a")
    assert me.pid == os.getpid() and me.boot_id == claims.boot_id() and me.boot_id
    assert me.start_time == claims.start_time(os.getpid()) and me.start_time >= 0
    assert me.pid_ns == os.stat("/proc/self/ns/pid").st_ino
    assert WriterIdentity.from_json(me.to_json()) == me
    assert me.alive(WriterIdentity.new("run-b"))


def test_a_claim_whose_pid_now_belongs_to_another_process_is_taken_over(tmp_path: Path) -> None:
    # The pid is alive (this very process) but started at another time: the writer is gone,
    # however fresh its heartbeat, even for the anonymous run id every single-process run shares.
    gone = replace(WriterIdentity.new("local"), writer="0ld0ld0ld0ld", start_time=WriterIdentity.new("x").start_time + 1)
    written(tmp_path, gone)
    mine = WriterIdentity.new("local")
    assert not gone.alive(mine)
    CheckpointStore(tmp_path).prepare(mine)
    assert CheckpointStore(tmp_path).writer() == mine


def test_a_live_writer_of_another_job_is_refused_and_the_same_named_run_takes_over(tmp_path: Path) -> None:
    other = replace(WriterIdentity.new("run-other"), writer="0th3r0th3r00")  # this process: alive
    written(tmp_path, other)
    with pytest.raises(CheckpointStorageError, match=rf"written by another job \(run run-other on .*, pid {os.getpid()}"):
        claims.claim(tmp_path, replace(WriterIdentity.new("run-mine"), pid=os.getpid() + 1))
    # Two anonymous runs are two jobs: refused.
    written(tmp_path, replace(other, run_id="local"))
    with pytest.raises(CheckpointStorageError):
        claims.claim(tmp_path, replace(WriterIdentity.new("local"), pid=os.getpid() + 1))
    # The same named run restarting: its new rank 0 takes over, live old one or not.
    written(tmp_path, other)
    successor = replace(WriterIdentity.new("run-other"), pid=os.getpid() + 1)
    claims.claim(tmp_path, successor)
    assert claims.current(tmp_path) == successor


def test_a_writer_out_of_sight_in_another_pid_namespace_is_never_dead_for_that_alone(tmp_path: Path) -> None:
    me = WriterIdentity.new("run-mine")
    assert me.token and me.net_ns == os.stat("/proc/self/ns/net").st_ino
    # A container beside this one (docker --ipc=host --network=host): same kernel, same host name,
    # another pid namespace no process we see lives in. Its pid means nothing here; its token does.
    beside = replace(me, writer="bes1debes1de", run_id="local", pid=1, pid_ns=1, start_time=0)  # holds me's token
    assert beside.alive(me)
    assert beside.alive(me) == replace(beside, heartbeat=time.time() - 1801).alive(me)  # the token, not the heartbeat
    written(tmp_path, beside)
    with pytest.raises(CheckpointStorageError, match="written by another job"):
        claims.claim(tmp_path, replace(me, writer="n3wn3wn3wn3w"))
    # This container's previous life on the host's network: its token is free, so it is gone.
    previous = replace(beside, writer="prev1ous0000", token="0" * 32)
    assert not previous.alive(me)
    written(tmp_path, previous)
    claims.claim(tmp_path, me)
    assert claims.current(tmp_path) == me
    # In another network namespace (or of a release without tokens) only the heartbeat tells,
    # on this host name as on any other.
    for unseen in (replace(previous, net_ns=1), replace(previous, token="", net_ns=0),
                   replace(previous, net_ns=1, host="another-pod.invalid")):
        assert unseen.alive(me)
        assert not replace(unseen, heartbeat=time.time() - 1801).alive(me)
        written(tmp_path, unseen)
        with pytest.raises(CheckpointStorageError, match=unseen.host):
            claims.claim(tmp_path, replace(me, writer="n3wn3wn3wn3w"))


def test_a_fifo_or_device_as_writer_json_is_refused_without_blocking(tmp_path: Path, caplog) -> None:
    os.mkfifo(tmp_path / WRITER)  # a plain open() for reading would wait for a writer forever
    with caplog.at_level(logging.WARNING):
        assert claims.current(tmp_path) is None
    assert "not a regular file" in caplog.text
    big = tmp_path / "big"
    big.mkdir()
    (big / WRITER).write_bytes(b" " * (claims.MAX_CLAIM_BYTES + 1))
    assert claims.current(big) is None
    device = tmp_path / "device"
    device.mkdir()
    (device / WRITER).symlink_to("/dev/zero")
    assert claims.current(device) is None


def test_a_writer_this_process_can_see_in_a_child_namespace_is_found(monkeypatch) -> None:
    me = WriterIdentity.new("run-mine")
    child = replace(me, writer="ch1ldch1ld00", run_id="other", pid=7, pid_ns=4242)
    monkeypatch.setattr(claims, "pid_namespace", lambda pid="self": 4242 if pid == str(os.getpid()) else me.pid_ns)
    monkeypatch.setattr(claims, "_nspid", lambda pid: 7 if pid == str(os.getpid()) else None)
    assert child.alive(me)
    assert not replace(child, start_time=me.start_time + 1).alive(me)


def test_a_claim_from_before_this_host_rebooted_is_dead_from_another_host_it_lives_by_heartbeat() -> None:
    me = WriterIdentity.new("run-mine")
    rebooted = replace(me, writer="b00tb00tb00t", boot_id="00000000-0000-0000-0000-000000000000")
    assert not rebooted.alive(me)
    elsewhere = replace(rebooted, host="elsewhere.invalid")
    assert elsewhere.alive(me)
    assert not replace(elsewhere, heartbeat=time.time() - 1801).alive(me)


@pytest.mark.parametrize(
    "change",
    [
        {"pid": "12"}, {"pid": True}, {"pid": 0}, {"pid": 2**40}, {"start_time": 1.5}, {"start_time": None},
        {"heartbeat": "soon"}, {"heartbeat": float("inf")}, {"stale_after": -1}, {"writer": ""}, {"writer": "a/b"},
        {"run_id": 7}, {"run_id": "x" * 300}, {"host": "a\nb"}, {"boot_id": "not-a-boot-id"}, {"pid_ns": -1},
        {"token": "../x"}, {"net_ns": -1},
        {"start_time": None, "boot_id": None, "pid_ns": None},  # a claim of an older release
    ],
)
def test_an_invalid_claim_counts_as_none_with_one_warning(tmp_path: Path, caplog, change: dict) -> None:
    raw = json.loads(WriterIdentity.new("run-a").to_json())
    raw.update(change)
    (tmp_path / WRITER).write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    with caplog.at_level(logging.WARNING, logger="elastic._shared.storage.claim"):
        assert claims.current(tmp_path) is None
        assert claims.current(tmp_path) is None
    warnings = [r.getMessage() for r in caplog.records if WRITER in r.getMessage()]
    assert len(warnings) == 1 and "counts as none" in warnings[0] and "\n" not in warnings[0]
    mine = WriterIdentity.new("run-b")
    CheckpointStore(tmp_path).prepare(mine)
    assert claims.current(tmp_path) == mine


@pytest.mark.parametrize("text", ["[]", "null", "{not json", '"text"', "\udcff"])
def test_a_claim_that_is_no_object_counts_as_none(tmp_path: Path, text: str) -> None:
    (tmp_path / WRITER).write_bytes(text.encode("utf-8", errors="surrogateescape"))
    assert claims.current(tmp_path) is None


def test_the_start_time_is_read_past_a_command_name_with_spaces_and_parentheses(monkeypatch, tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    fields = ["S"] + [str(n) for n in range(4, 22)] + ["987654"] + ["0"] * 30
    stat.write_text("4242 (a) b (c) " + " ".join(fields) + "\n")
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: real(stat if str(self) == "/proc/4242/stat" else self, *a, **k))
    assert claims.start_time(4242) == 987654


def test_a_process_start_is_dated_to_a_clock_tick_not_to_the_whole_second_of_boot() -> None:
    """A hang's culprit agent leaves alone a worker that started after the stall began (a replacement):
    dated through /proc/stat's whole-second btime, one that started 0.6 s into the stall read as older
    than it and was ended for it (elastic._agent.launcher.hang_verdicts)."""
    import threading

    for _ in range(3):  # a thread is a task /proc dates like a process, and needs none started
        ready, done = threading.Event(), threading.Event()
        tid: list[int] = []
        before = time.time()
        thread = threading.Thread(target=lambda: (tid.append(threading.get_native_id()), ready.set(), done.wait(5)))
        thread.start()
        ready.wait(5)
        after = time.time()
        try:
            started = claims.started_at(tid[0])
        finally:
            done.set()
            thread.join()
        # (a tick's rounding and a loaded machine's preemption allowed: btime's whole second is not)
        assert started is not None and before - 0.1 <= started <= after + 0.1, (before, started, after)
        time.sleep(0.37)  # another fraction of a second each time
    assert claims.started_at(2**22 + 7) is None  # no such process


def test_a_job_that_ended_lets_the_next_job_on_any_host_take_the_directory_at_once(tmp_path: Path) -> None:
    """A claim of another host is judged by its heartbeat (30 minutes); one its job marked as ended is not."""
    me = WriterIdentity.new("slurm-8")
    elsewhere = replace(me, writer="3ls3wh3r3000", run_id="slurm-7", host="elsewhere.invalid",
                        boot_id="00000000-0000-0000-0000-000000000000")
    written(tmp_path, elsewhere)
    with pytest.raises(CheckpointStorageError, match="written by another job"):
        claims.claim(tmp_path, me)
    claims.release(tmp_path, replace(elsewhere, writer="n0tth3wr1t3r"))  # not the holder: no change
    assert claims.current(tmp_path) == elsewhere
    claims.release(tmp_path, elsewhere)
    ended = claims.current(tmp_path)
    assert ended is not None and ended.heartbeat == 0.0 and ended.run_id == "slurm-7"  # a keeper of it may commit
    claims.check_may_commit(tmp_path, "slurm-7")
    claims.claim(tmp_path, me)
    assert claims.current(tmp_path).writer == me.writer
