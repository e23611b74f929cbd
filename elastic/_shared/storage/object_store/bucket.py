"""A checkpoint store in a bucket: a directory's guarantees without a rename.

Layout under `s3://BUCKET/PREFIX`:

    step_00000100/manifest.json          the commit: a checkpoint exists once this object does
    step_00000100/<attempt>/shard_00000.bin, ..., tensors.json, trainer.pt
                                         the files of the save attempt the manifest names
    writer.json                          the claim (bucket_claim.py)
    latest                               names the newest committed checkpoint (a hint)
    corrupt/step_00000050.<time>.json    the manifest of a checkpoint that failed verification

Invariants:
- Every rank uploads its own shard into the save's attempt folder
  (`<saver tag>`), in parallel ranges (transfer.PartUpload); rank 0 then
  uploads tensors.json and trainer.pt and commits. Every upload is
  create-only: no save ever replaces an object, so a committed checkpoint's
  files are never overwritten, whoever writes the same step later.
- The commit is one object, `step_N/manifest.json`, created with
  `If-None-Match: *` after every file is uploaded and the claim is checked.
  It names the attempt folder and every file with its size, and the small
  files with their crc32c (the shards' chunks carry theirs in tensors.json).
  Until it exists nothing of the save is a checkpoint: a torn upload (a kill
  between the last part and the manifest, a failed part) is never listed, and
  a multipart object is never seen half written.
- Two writers of one step (rank 0 and a keeper, or a retried request whose
  first try succeeded unseen): the create of the second fails; it reads the
  manifest there and, when that checkpoint checks, discards its own upload.
  A manifest there that does not check is moved aside (`corrupt/`) and the
  create is tried once more.
- `committed()` lists the prefix: the newest committed manifests first. The
  `latest` object is only a hint, written after the commit, never moved back.
- Restore checks every file against the manifest (sizes by listing, the small
  files' crc32c, every chunk's crc32c as it is read); a checkpoint that fails
  is skipped for the previous one (disk_source.py), its manifest moved aside
  once an older one restored.
- Retention (after a commit, while the claim is still the committer's or its
  job's): the newest `keep` checkpoints of this run whose manifest, file
  sizes and small files check stay; behind them, checkpoints of this run are
  deleted, manifest first (so none is ever seen without its files). Another
  run's checkpoints and anything unrecognised stay.
- Orphans (attempt folders no manifest names: saves that died, losers of a
  race) are deleted when a job claims the prefix (`prepare`), and behind each
  commit for the steps up to the committed one.
- Everything read from the bucket is untrusted (bucket_reader.py, which reads
  and checks what is committed).
"""

from __future__ import annotations

import io
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import PurePosixPath
from typing import Any

import crc32c
import torch

from elastic._shared.common.errors import CorruptCheckpoint
from elastic._shared.storage import validate
from elastic._shared.storage.claim import WRITER, WriterIdentity
from elastic._shared.storage.durable import SaveFailed, describe_failure
from elastic._shared.storage.location import BucketLocation
from elastic._shared.storage.manifest import MANIFEST, MAX_MANIFEST_BYTES, Candidate, Manifest, checkpoint_name
from elastic._shared.storage.object_store import bucket_retention
from elastic._shared.storage.object_store.bucket_claim import BucketClaim
from elastic._shared.storage.object_store.bucket_reader import ATTEMPT, LATEST, STEP, BucketReader
from elastic._shared.storage.object_store.objects import ConditionFailed, ObjectMissing, Objects, ObjectTooLarge
from elastic._shared.storage.object_store.transfer import PartUpload

logger = logging.getLogger(__name__)

CORRUPT = "corrupt"


@dataclass(frozen=True)
class BucketStage:
    """Where one save attempt of `step` uploads its files: `<prefix>/step_N/<attempt>/`."""

    step: int
    attempt: str
    folder: str
    """The attempt folder's key (no trailing slash)."""

    @property
    def name(self) -> str:
        return f"{checkpoint_name(self.step)}/{self.attempt}"

    def key(self, file_name: str) -> str:
        return f"{self.folder}/{file_name}"


class BucketStore(BucketReader):
    """The checkpoints under one bucket prefix: the methods of a directory's `CheckpointStore`
    (directory.py), on a bucket (see the module docstring); reading is `BucketReader`'s."""

    def __init__(self, location: BucketLocation, objects: Objects, *, keep: int = 3, keep_corrupt: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep} must be at least 1")
        super().__init__(location, objects)
        self.keep = keep
        self.keep_corrupt = keep_corrupt
        self._claim = BucketClaim(objects, location.key(WRITER), str(location))
        self._checked: set[tuple[str, str]] = set()
        """(checkpoint, manifest text) that counted towards `keep` in this process."""

    # -- ownership -------------------------------------------------------------------

    def prepare(self, identity: WriterIdentity | None = None) -> None:
        """Claim the prefix for `identity` and delete the attempts no manifest names (saves that died)."""
        if identity is not None:
            self.claim(identity)
        self._remove_orphans(up_to=None)

    def writer(self) -> WriterIdentity | None:
        return self._claim.current()[0]

    def claim(self, identity: WriterIdentity) -> None:
        self._claim.claim(identity)

    def heartbeat(self, identity: WriterIdentity) -> None:
        self._claim.refresh(identity)

    def release(self, identity: WriterIdentity) -> None:
        self._claim.release(identity)

    def check_owner(self, identity: WriterIdentity) -> None:
        self._claim.check_may_commit(identity.run_id, identity)

    def check_may_commit(self, run_id: str, owner: WriterIdentity | None = None) -> None:
        """`SaveFailed` unless the prefix is `owner`'s, or without one (a keeper), its job's (`run_id`)."""
        self._claim.check_may_commit(run_id, owner)

    def check_room(self, needed_bytes: int) -> None:
        """A bucket has no free-space figure: a save that finds no room fails and says so."""

    # -- writing ---------------------------------------------------------------------

    def begin(self, step: int, tag: str) -> BucketStage:
        """The attempt folder of a save of `step` (every rank of the save uploads into it)."""
        attempt = tag if ATTEMPT.match(tag) else uuid.uuid4().hex[:12]
        return BucketStage(step, attempt, self.root.key(checkpoint_name(step), attempt))

    def part_sink(self, stage: BucketStage) -> Callable[[str], PartUpload]:
        """How a rank's shard writer opens `file_name` in the stage: an upload streamed in parallel parts."""
        return lambda file_name: PartUpload(self.objects, stage.key(validate.need_name(file_name, "a shard file")))

    def write_bytes(self, stage: BucketStage, file_name: str, data: bytes) -> dict[str, Any]:
        """`data` uploaded as `file_name` of the stage; its size and crc32c."""
        with PartUpload(self.objects, stage.key(file_name)) as upload:
            upload.write(data)
        return {"bytes": len(data), "crc32c": crc32c.crc32c(data)}

    def write_state_file(self, stage: BucketStage, file_name: str, obj: Any) -> dict[str, Any]:
        """`obj` saved with torch.save and uploaded as `file_name`; its size and crc32c."""
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return self.write_bytes(stage, file_name, buffer.getvalue())

    def abort(self, stage: BucketStage) -> None:
        """Delete what a failed save uploaded (never the files a manifest names)."""
        try:
            named = self._manifest_of(Candidate(checkpoint_name(stage.step), stage.step, None)).parts  # type: ignore[arg-type]
        except (CorruptCheckpoint, OSError):
            named = None
        if named == stage.attempt:
            return
        try:
            self.objects.delete([o.key for o in self.objects.list(stage.folder + "/")])
        except OSError as exc:
            logger.warning("cannot delete the upload of a failed save in %s: %s (deleted at the next start)",
                           stage.folder, describe_failure(exc))

    def finish(
        self,
        stage: BucketStage,
        manifest: Manifest,
        *,
        owner: WriterIdentity | None = None,
        before_commit: Callable[[], None] = lambda: None,
    ) -> str:
        """Commit `manifest` (every file named uploaded into `stage`) as checkpoint `manifest.step`: one
        create-only manifest object, after the claim is checked (see the module docstring)."""
        name = checkpoint_name(manifest.step)
        manifest = replace(manifest, parts=stage.attempt)
        text = manifest.to_json()
        before_commit()
        try:
            self._claim.check_may_commit(manifest.run_id, owner)
        except SaveFailed:
            self.abort(stage)
            raise
        except OSError as exc:
            self.abort(stage)
            raise SaveFailed(f"cannot commit {name} in {self.root}: {describe_failure(exc)}") from None
        key = self.root.key(name, MANIFEST)
        for attempt in range(2):
            try:
                self.objects.put(key, text.encode("utf-8"), create_only=True)
                self._manifests[name] = (text, manifest)
                break
            except ConditionFailed:
                there = self._commit_there(name, manifest.step)
                if there is None and attempt == 0:
                    continue  # a corrupt commit was moved aside: create ours
                if there is None or there.parts != stage.attempt:
                    self.abort(stage)
                if there is None:
                    raise SaveFailed(f"cannot commit {name} in {self.root}: its manifest keeps changing") from None
                logger.info("%s was committed by another writer meanwhile and checks; this copy goes", name)
                break
            except OSError as exc:
                self.abort(stage)
                raise SaveFailed(f"cannot commit {name} in {self.root}: {describe_failure(exc)}") from None
        # Committed. What follows is housekeeping: a failure there is a warning, not a failed save.
        self.mark_checked(name)
        try:
            self._write_latest(name)
            if owner is not None:
                holder = self.writer()
                if holder is None or holder.writer == owner.writer:
                    self._claim.refresh(owner)
            self.retire_old(manifest.run_id, owner, newest=manifest.step)
        except (OSError, SaveFailed) as exc:
            logger.warning("%s committed, but tidying %s failed: %s", name, self.root, describe_failure(exc))
        return self.root / name

    def _commit_there(self, name: str, step: int) -> Manifest | None:
        """The manifest another writer committed for `name`, if that checkpoint checks; else it is moved
        aside and None."""
        candidate = Candidate(name, step, PurePosixPath(self.root.key(name)))  # type: ignore[arg-type]
        try:
            manifest = self.read_checked_manifest(candidate)
            self.check_sizes(candidate, manifest)
            return manifest
        except CorruptCheckpoint as exc:
            logger.warning("%s was committed before but does not check (%s): moving it aside", name, exc)
            self.quarantine(candidate)
            return None

    def _write_latest(self, name: str) -> None:
        pointed = self.latest_pointer()
        if pointed is not None and STEP.match(pointed) and pointed > name:
            return
        self.objects.put(self.root.key(LATEST), (name + "\n").encode("ascii"))

    # -- retention and orphans (bucket_retention.py) ----------------------------------

    def retire_old(self, run_id: str, owner: WriterIdentity | None, *, newest: int) -> list[str]:
        """Delete this run's checkpoints behind the newest `keep` that check, then orphans up to `newest`."""
        return bucket_retention.retire_old(self, run_id, owner, newest=newest)

    def _remove_orphans(self, *, up_to: int | None) -> None:
        bucket_retention.remove_orphans(self, up_to=up_to)

    def mark_checked(self, name: str) -> None:
        """`name`'s checkpoint checks (or this process committed it): retention need not read it again."""
        self._checked.add((name, self._manifests[name][0]))

    def was_checked(self, name: str) -> bool:
        cached = self._manifests.get(name)
        return cached is not None and (name, cached[0]) in self._checked

    def forget(self, name: str) -> None:
        self._manifests.pop(name, None)

    def quarantine(self, candidate: Candidate) -> PurePosixPath:
        """Move a checkpoint that failed verification aside: its manifest goes to `corrupt/` (the
        newest `keep_corrupt` stay), so it is no longer committed; its files become orphans. The key it
        went to, as a path (`.name`, as a directory's quarantine returns)."""
        key = self.root.key(candidate.name, MANIFEST)
        target = self.root.key(CORRUPT, f"{candidate.name}.{time.time_ns()}.json")
        try:
            raw, _ = self.objects.get(key, limit=MAX_MANIFEST_BYTES)
            self.objects.put(target, raw, create_only=True)
        except (ObjectMissing, ObjectTooLarge):
            pass
        self.objects.delete([key])
        self._manifests.pop(candidate.name, None)
        aside = sorted(self.objects.list(self.root.key(CORRUPT) + "/"), key=lambda o: (o.modified, o.key), reverse=True)
        stale = [o.key for o in aside[self.keep_corrupt :]]
        if stale:
            self.objects.delete(stale)
        return PurePosixPath(target)
