"""Which job writes a checkpoint directory: `writer.json`, the claim.

Invariants:
- One job writes a directory at a time. Rank 0 claims it at restore (`claim`),
  refusing (one line, `CheckpointStorageError`) a directory another live job
  writes, and keeps the claim fresh (`refresh`) between rare commits.
- Every commit checks the claim just before its rename (`check_may_commit`):
  rank 0 commits only while the claim is still its own; a snapshot keeper,
  which commits on behalf of its job's workers, only while the claim is its
  job's (same run id). A writer that lost the directory commits nothing there.
- A claim is replaced atomically (durable.replace_small); an unreadable one
  counts as none.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from elastic.errors import CheckpointStorageError
from elastic.storage.durable import SaveFailed, replace_small

logger = logging.getLogger(__name__)

WRITER = "writer.json"


@dataclass(frozen=True)
class WriterIdentity:
    """Who writes a checkpoint directory (writer.json): one per rank 0 of a job's run."""

    writer: str
    """Unique per writing process (a new rank 0 after a restart is a new writer)."""
    run_id: str
    host: str
    pid: int
    heartbeat: float
    stale_after: float = 1800.0
    """A claim older than this (seconds since its heartbeat) from another host is taken to be dead."""

    @classmethod
    def new(cls, run_id: str, *, stale_after: float = 1800.0) -> WriterIdentity:
        return cls(uuid.uuid4().hex[:12], run_id, socket.gethostname(), os.getpid(), time.time(), stale_after)

    def beat(self) -> WriterIdentity:
        return WriterIdentity(self.writer, self.run_id, self.host, self.pid, time.time(), self.stale_after)

    def alive(self, observer: WriterIdentity) -> bool:
        """Whether this claim's writer may still be writing, as `observer` can tell."""
        if self.host == observer.host:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
            return True
        return time.time() - self.heartbeat < self.stale_after

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> WriterIdentity:
        raw = json.loads(text)
        return cls(
            str(raw["writer"]), str(raw["run_id"]), str(raw["host"]), int(raw["pid"]), float(raw["heartbeat"]),
            float(raw.get("stale_after", 1800.0)),
        )


def current(root: Path) -> WriterIdentity | None:
    """Who claimed `root` last (None: nobody, or an unreadable claim)."""
    try:
        return WriterIdentity.from_json((root / WRITER).read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def claim(root: Path, identity: WriterIdentity) -> None:
    """Make `identity` the directory's writer; `CheckpointStorageError` if another live job writes here."""
    holder = current(root)
    # The same job's earlier rank 0 on another host (a restart moved it, or a partition
    # cut it off) is taken over: it is refused at its next commit. Anything else alive
    # is another job, two single-process runs ("local") included; an earlier
    # writer in this very process (a manager made again) is no other job.
    if holder is not None and holder.writer != identity.writer:
        same_job_elsewhere = holder.run_id == identity.run_id and holder.host != identity.host
        this_process = holder.host == identity.host and holder.pid == identity.pid
        if not same_job_elsewhere and not this_process and holder.alive(identity):
            raise CheckpointStorageError(
                f"{root} is written by another job (run {holder.run_id} on {holder.host}, pid {holder.pid}, "
                f"seen {time.time() - holder.heartbeat:.0f} s ago): give each job its own --ckpt-dir "
                f"(or delete {root / WRITER} if that job is gone)"
            )
        if holder.run_id != identity.run_id:
            logger.warning("taking over %s from run %s on %s, which is gone", root, holder.run_id, holder.host)
    replace_small(root, WRITER, identity.to_json())


def refresh(root: Path, identity: WriterIdentity) -> None:
    """Refresh the claim (a job that saves rarely still looks alive); `SaveFailed` if it was lost."""
    check_may_commit(root, identity.run_id, identity)
    replace_small(root, WRITER, identity.beat().to_json())


def refresh_after_commit(root: Path, identity: WriterIdentity) -> None:
    """After a commit: the claim's heartbeat is the commit's time, unless a newer claim replaced it."""
    holder = current(root)
    if holder is None or holder.writer == identity.writer:
        replace_small(root, WRITER, identity.beat().to_json())


def check_may_commit(root: Path, run_id: str, owner: WriterIdentity | None = None) -> None:
    """`SaveFailed` unless the directory is still `owner`'s (rank 0), or, without an owner, still
    claimed by a writer of run `run_id` (a keeper committing for its job's workers)."""
    holder = current(root)
    if holder is None:
        return
    if owner is not None and holder.writer != owner.writer:
        raise SaveFailed(
            f"{root} is now written by another writer (run {holder.run_id} on {holder.host}, pid "
            f"{holder.pid}); this one stops writing there"
        )
    if owner is None and holder.run_id != run_id:
        raise SaveFailed(
            f"{root} is now written by another job (run {holder.run_id} on {holder.host}); "
            f"nothing of run {run_id} is committed there"
        )
