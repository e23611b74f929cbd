"""What a bucket's commit deletes: older checkpoints of this run, and uploads no manifest names.

Invariants (bucket.py's module docstring has the whole protocol):
- Nothing is deleted unless the claim is still the committer's (rank 0) or
  its job's (a keeper): a writer that lost the prefix deletes nothing there.
- The newest `store.keep` checkpoints of the committing run whose manifest,
  file sizes and small files' crc32c check stay, and everything newer than
  the last of them. (The tensors' own checksums are checked when they are
  restored; checking them here would download every kept checkpoint.)
  Another run's checkpoints, and any whose manifest does not read, never
  count and are never deleted.
- A checkpoint is deleted manifest first: none is ever seen without its files.
- An orphan is an object in an attempt folder (`step_N/<attempt>/...`) that no
  committed manifest names; a step whose manifest does not read keeps all
  its folders (nothing is deleted on a guess).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Protocol

from elastic._shared.common.errors import CorruptCheckpoint
from elastic._shared.storage.claim import WriterIdentity
from elastic._shared.storage.durable import SaveFailed
from elastic._shared.storage.location import BucketLocation
from elastic._shared.storage.manifest import MANIFEST, Candidate, Manifest
from elastic._shared.storage.object_store.objects import Objects

logger = logging.getLogger(__name__)
_STEP = re.compile(r"^step_(\d{8})$")


class RetentionTarget(Protocol):
    """What retention needs of the bucket store it deletes from (bucket.BucketStore)."""

    root: BucketLocation
    objects: Objects
    keep: int

    def check_may_commit(self, run_id: str, owner: WriterIdentity | None = None) -> None: ...
    def committed(self) -> list[Candidate]: ...
    def read_manifest(self, candidate: Candidate) -> Manifest: ...
    def read_checked_manifest(self, candidate: Candidate) -> Manifest: ...
    def check_sizes(self, candidate: Candidate, manifest: Manifest) -> None: ...
    def read_file(self, candidate: Candidate, file_name: str, expected: Any, *, keep: bool = True) -> bytes: ...
    def was_checked(self, name: str) -> bool: ...
    def mark_checked(self, name: str) -> None: ...
    def forget(self, name: str) -> None: ...


def retire_old(store: RetentionTarget, run_id: str, owner: WriterIdentity | None, *, newest: int) -> list[str]:
    """Delete run `run_id`'s checkpoints behind the newest `store.keep` of it that check, then the
    orphans of steps up to `newest`; the names deleted."""
    try:
        store.check_may_commit(run_id, owner)
    except SaveFailed as exc:
        logger.warning("not deleting old checkpoints: %s", exc)
        return []
    kept, deleted = 0, []
    for old in store.committed():
        try:
            manifest = store.read_checked_manifest(old)
        except (CorruptCheckpoint, OSError):
            continue  # not recognisably a checkpoint: it stays
        if manifest.run_id != run_id:
            continue  # another run's: never counted, never deleted
        if kept < store.keep:
            kept += _counts(store, old, manifest)
            continue
        store.objects.delete([store.root.key(old.name, MANIFEST)])  # first: never a manifest without its files
        store.objects.delete([o.key for o in store.objects.list(store.root.key(old.name) + "/")])
        store.forget(old.name)
        deleted.append(old.name)
        logger.debug("deleted %s (keeping the newest %d of run %s)", old.name, store.keep, run_id)
    remove_orphans(store, up_to=newest)
    return deleted


def _counts(store: RetentionTarget, candidate: Candidate, manifest: Manifest) -> bool:
    """Whether `candidate` checks (once per manifest per process; a commit marks its own)."""
    if store.was_checked(candidate.name):
        return True
    try:
        store.check_sizes(candidate, manifest)
        for file_name, expected in manifest.files.items():
            if "crc32c" in expected or "sha256" in expected:
                store.read_file(candidate, file_name, expected, keep=False)
    except (CorruptCheckpoint, OSError) as exc:
        logger.info("%s does not count towards keeping %d: %s", candidate.name, store.keep, exc)
        return False
    store.mark_checked(candidate.name)
    return True


def remove_orphans(store: RetentionTarget, *, up_to: int | None) -> None:
    """Delete the objects of attempt folders no committed manifest names, of steps up to `up_to` (None: all)."""
    prefix = store.root.key() + "/" if store.root.prefix else ""
    split = [(info.key, info.key[len(prefix):].split("/")) for info in store.objects.list(prefix)]
    committed = {p[0] for _, p in split if len(p) == 2 and p[1] == MANIFEST and _STEP.match(p[0])}
    named: dict[str, str | None] = {}
    """Step -> the attempt its manifest names (None: no manifest)."""
    unreadable: set[str] = set()
    orphans: list[str] = []
    for key, parts in split:
        if len(parts) < 3 or not _STEP.match(parts[0]) or (up_to is not None and int(parts[0][5:]) > up_to):
            continue
        step = parts[0]
        if step not in named and step not in unreadable:
            named[step] = None
            if step in committed:
                try:
                    named[step] = store.read_manifest(Candidate(step, int(step[5:]), None)).parts  # type: ignore[arg-type]
                except (CorruptCheckpoint, OSError):
                    del named[step]
                    unreadable.add(step)
        if step not in unreadable and parts[1] != named[step]:
            orphans.append(key)
    if orphans:
        logger.info("deleting %d objects of saves that never committed in %s", len(orphans), store.root)
        store.objects.delete(orphans)
