"""Where a host's snapshot keepers live: this user's private directory, its keepers' owners, and the secret.

Layout, under the snapshot base (/dev/shm, or TORCHREVIVE_SNAPSHOT_BASE):

    torchrevive-snapshots-<uid>/         mode 0700, this user's (`private_directory`)
        <host>-<pid>-<tag>/owner.json    each keeper's directory and who runs it
        .secrets/<run>-<hash>            a run's secret, made on this host (mode 0600)
        .secrets/<run>-<hash>.given      a run's secret given in TORCHREVIVE_SNAPSHOT_SECRET (mode 0600)

Invariants:
- Nothing of a job lies where another local user can read or replace it: the
  private directory is checked (lstat: a real directory, this user's, mode 0700)
  before anything is put in it.
- Whatever is read back from it is checked before use: owner.json only as a
  small regular file holding an object, pids only within what Linux hands out.
- A keeper's directory is removed only when its keeper is known to be gone
  (`keeper_alive`): owner.json names it by host, boot id, pid namespace, pid
  and start time, plus a liveness token (storage/liveness.py). Containers side
  by side share /dev/shm and a host name but not their pids, so a keeper of
  another pid namespace is judged by its token (same network namespace) or
  else by its heartbeat (owner.json's mtime, touched every second while it
  runs: `OWNER_STALE`), never by "its pid is not visible here".
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from elastic._agent.timings import OWNER_STALE, STALE_SECRET
from elastic._shared.common.errors import CorruptCheckpoint
from elastic._shared.storage import liveness, secret_files
from elastic._shared.storage.claim import boot_id, pid_namespace, start_time
from elastic._shared.storage.job_secret import BASE_ENV, DIRECTORY, private_directory, snapshot_base  # noqa: F401
from elastic._shared.storage.validate import read_bounded

OWNER_FILE = "owner.json"
SECRETS = secret_files.SECRETS_DIRECTORY
PID_MAX = 2**22
"""The largest pid Linux hands out (pid_max's ceiling)."""


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (a pid no kernel hands out, read from a crafted file, does not)."""
    if not 0 < pid <= PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_record(run_id: str) -> dict[str, Any]:
    """What a keeper writes to its owner.json: who runs it, as `keeper_alive` can check across pid namespaces."""
    me = os.getpid()
    started = start_time(me)
    return {"host": socket.gethostname(), "pid": me, "run_id": run_id, "boot_id": boot_id(), "pid_ns": pid_namespace(),
            "start_time": -1 if started is None else started, "net_ns": liveness.net_namespace(),
            "token": liveness.own_token()}


def keeper_alive(owner: dict[str, Any], heartbeat: float) -> bool:
    """Whether the keeper `owner` (an owner.json of this host name, its mtime `heartbeat`) may still run.
    Its pid is trusted only in our own pid namespace; elsewhere its token or its heartbeat tells."""
    pid, ns, started = owner.get("pid"), owner.get("pid_ns"), owner.get("start_time")
    if not (type(pid) is int and 0 < pid <= PID_MAX):
        return False
    ours = boot_id()
    if ours and owner.get("boot_id") and owner.get("boot_id") != ours:
        return False  # this host name's machine rebooted since
    if type(ns) is int and ns != 0 and ns == pid_namespace():
        if type(started) is int and started >= 0:
            return start_time(pid) == started  # a pid handed out again is another process
        return pid_alive(pid)
    token, net = owner.get("token"), owner.get("net_ns")
    if isinstance(token, str) and type(net) is int and net != 0 and net == liveness.net_namespace():
        held = liveness.token_alive(token)
        if held is not None:
            return held
    return time.time() - heartbeat < OWNER_STALE


def live_keepers_of(base: Path, run_id: str) -> bool:
    """Whether a keeper of run `run_id` on this host is still running (its directory is under `base`)."""
    host = socket.gethostname()
    for entry in os.scandir(base):
        owner, heartbeat = _owner(Path(entry.path))
        if owner.get("host") == host and owner.get("run_id") == run_id and keeper_alive(owner, heartbeat):
            return True
    return False


def _owner(directory: Path) -> tuple[dict[str, Any], float]:
    """A keeper directory's owner.json and its mtime (the keeper's heartbeat); ({}, 0) when it is
    unreadable, not a small regular file, or not an object."""
    try:
        heartbeat = os.stat(directory / OWNER_FILE, follow_symlinks=False).st_mtime
        owner = json.loads(read_bounded(directory / OWNER_FILE, OWNER_FILE, 4096))
    except (OSError, ValueError, CorruptCheckpoint, RecursionError):
        return {}, 0.0
    return (owner, heartbeat) if isinstance(owner, dict) else ({}, 0.0)


def remove_orphans(base: Path) -> None:
    """Directories of keepers on this host whose process is gone (killed before it could clean up),
    and the secrets made here for runs no live keeper serves that are older than `STALE_SECRET`
    (a run's first agent makes its secret a moment before its keeper's directory exists)."""
    host = socket.gethostname()
    live_runs = set()
    for entry in os.scandir(base):
        owner, heartbeat = _owner(Path(entry.path))
        if owner.get("host") != host or not isinstance(owner.get("pid"), int):
            continue
        if keeper_alive(owner, heartbeat):
            live_runs.add(str(owner.get("run_id")))
        else:
            shutil.rmtree(entry.path, ignore_errors=True)
    wanted = {name for run in live_runs for name in (secret_files.host_secret_name(run), secret_files.given_secret_name(run))}
    try:
        secrets = list(os.scandir(base / SECRETS))
    except OSError:
        return
    for entry in secrets:
        with contextlib.suppress(OSError):
            if entry.name not in wanted and time.time() - entry.stat(follow_symlinks=False).st_mtime > STALE_SECRET:
                os.unlink(entry.path)
