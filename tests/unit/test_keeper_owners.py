"""Keepers' directories on a /dev/shm shared by containers side by side (docker --ipc=host
--network=host): a keeper of another pid namespace is judged by its liveness token or its
heartbeat, never removed because its pid is not visible here (elastic/_agent/launcher/keeper_files.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from elastic._agent.launcher import keeper_files
from elastic._agent.launcher.keeper_files import OWNER_FILE, keeper_alive, owner_record, remove_orphans


def keeper_dir(base: Path, name: str, owner: dict, *, age: float = 0.0) -> Path:
    directory = base / name
    directory.mkdir()
    (directory / OWNER_FILE).write_text(json.dumps(owner))
    when = time.time() - age
    os.utime(directory / OWNER_FILE, (when, when))
    return directory


def test_a_keeper_of_another_pid_namespace_is_judged_by_token_or_heartbeat_never_by_its_pid(tmp_path: Path) -> None:
    me = owner_record("run-a")
    assert me["pid_ns"] == os.stat("/proc/self/ns/pid").st_ino and me["token"]
    assert keeper_alive(me, time.time())
    # Beside us: another pid namespace, its pid not visible here. Its token is held (by this
    # process, standing in for it): alive, however old its heartbeat.
    beside = {**me, "pid": 4_000_000, "pid_ns": 1, "start_time": 0}
    assert keeper_alive(beside, 0.0)
    # Its token free: gone (a container on the host's network that ended).
    assert not keeper_alive({**beside, "token": "0" * 32}, time.time())
    # Another network namespace, or an owner.json without a token: its heartbeat tells.
    for unseen in ({**beside, "net_ns": 1}, {k: v for k, v in beside.items() if k not in ("token", "net_ns")}):
        assert keeper_alive(unseen, time.time() - keeper_files.OWNER_STALE + 60)
        assert not keeper_alive(unseen, time.time() - keeper_files.OWNER_STALE - 60)
    # Our own pid namespace: the pid and its start time (a pid handed out again is another process).
    assert not keeper_alive({**me, "start_time": me["start_time"] + 1}, time.time())
    assert not keeper_alive({**me, "boot_id": "00000000-0000-0000-0000-000000000000"}, time.time())


def test_orphan_removal_leaves_a_live_keeper_of_another_namespace_alone(tmp_path: Path) -> None:
    me = owner_record("run-a")
    beside = {**me, "pid": 4_000_000, "pid_ns": 1, "start_time": 0, "net_ns": 1, "token": "1" * 32}
    live = keeper_dir(tmp_path, "beside-live", beside, age=5)
    stale = keeper_dir(tmp_path, "beside-stale", beside, age=keeper_files.OWNER_STALE + 60)
    ended = keeper_dir(tmp_path, "host-net-ended", {**beside, "net_ns": me["net_ns"], "token": "0" * 32})
    mine_gone = keeper_dir(tmp_path, "mine-gone", {**me, "start_time": me["start_time"] + 1})
    remove_orphans(tmp_path)
    assert live.is_dir()
    assert not stale.exists() and not ended.exists() and not mine_gone.exists()


def test_an_owner_json_that_is_a_fifo_is_skipped_without_blocking(tmp_path: Path) -> None:
    directory = tmp_path / "fifo"
    directory.mkdir()
    os.mkfifo(directory / OWNER_FILE)
    remove_orphans(tmp_path)  # a plain read would wait for a writer forever
    assert directory.is_dir()  # not a keeper's as far as anyone can tell: left alone
