"""Which old checkpoints a commit deletes: retention counts only verified checkpoints of this run.

Invariants:
- Runs after a commit (directory.CheckpointStore._publish), and deletes only
  while the claim is still the committer's (rank 0) or its job's (a snapshot
  keeper): a writer that lost the directory deletes nothing there.
- The newest `keep` checkpoints that verify and belong to the committing run
  (`manifest.run_id`) stay, and so does everything newer than the last of
  them. A directory that does not verify, or another run's, never counts
  towards `keep`, so a crafted or foreign one cannot push a good one out.
- Behind them, a checkpoint is deleted only when its manifest reads and names
  its step; anything else there is not recognisably a checkpoint and stays.
- Verifying reads a checkpoint whole, so each is verified once per process
  (`mark_verified`, keyed by its manifest's inode, size and mtime); a commit
  marks its own.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Protocol

from elastic._shared.common.errors import CorruptCheckpoint
from elastic._shared.storage import claim as claims
from elastic._shared.storage.claim import WriterIdentity
from elastic._shared.storage.durable import SaveFailed
from elastic._shared.storage.manifest import MANIFEST, Candidate

logger = logging.getLogger(__name__)

_VERIFIED: dict[str, tuple[int, int, int]] = {}
"""Checkpoints this process verified (or committed), by path: their manifest's inode, size and mtime."""


class Store(Protocol):
    """What retention needs of a checkpoint directory (directory.CheckpointStore)."""

    root: Path
    keep: int

    def committed(self) -> list[Candidate]: ...

    def read_checked_manifest(self, candidate: Candidate) -> Any: ...

    def verify(self, candidate: Candidate) -> Any: ...


def retire_old(store: Store, run_id: str, owner: WriterIdentity | None) -> list[str]:
    """Delete what lies behind the newest `store.keep` verified checkpoints of run `run_id` (see
    the module docstring); the names deleted."""
    try:
        claims.check_may_commit(store.root, run_id, owner)
    except SaveFailed as exc:
        logger.warning("not deleting old checkpoints: %s", exc)
        return []
    kept, deleted = 0, []
    for old in store.committed():
        if kept < store.keep:
            kept += _counts(store, old, run_id)
            continue
        try:
            store.read_checked_manifest(old)
        except (CorruptCheckpoint, OSError):
            continue
        shutil.rmtree(old.path, ignore_errors=True)
        deleted.append(old.name)
        logger.debug("deleted %s (keeping the newest %d of run %s)", old.name, store.keep, run_id)
    return deleted


def _counts(store: Store, candidate: Candidate, run_id: str) -> bool:
    """Whether `candidate` is run `run_id`'s and verifies."""
    try:
        if store.read_checked_manifest(candidate).run_id != run_id:
            return False
        if not _was_verified(candidate.path):
            store.verify(candidate)
            mark_verified(candidate.path)
    except (CorruptCheckpoint, OSError) as exc:
        logger.info("%s does not count towards keeping %d: %s", candidate.name, store.keep, exc)
        return False
    return True


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        stat = (path / MANIFEST).stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def mark_verified(path: Path) -> None:
    """Note that the checkpoint at `path` verified (or was just committed by this process)."""
    stamp = _stamp(path)
    if stamp is not None:
        if len(_VERIFIED) > 4096:
            _VERIFIED.clear()
        _VERIFIED[str(path)] = stamp


def _was_verified(path: Path) -> bool:
    stamp = _stamp(path)
    return stamp is not None and _VERIFIED.get(str(path)) == stamp
