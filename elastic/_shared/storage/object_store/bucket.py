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
- Everything read from the bucket is untrusted: a manifest at most
  `MAX_MANIFEST_BYTES`, parsed by `Manifest.from_json`; its attempt a plain
  name; every file a bare name within the attempt folder; sizes checked
  before a byte is read, and nothing read past them.
"""

from __future__ import annotations

import io
import logging
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import PurePosixPath
from typing import Any

import crc32c
import torch

from elastic._shared.common.errors import CorruptCheckpoint
from elastic._shared.common.errors import first_line as _first_line
from elastic._shared.storage import validate
from elastic._shared.storage.claim import WRITER, WriterIdentity
from elastic._shared.storage.durable import SaveFailed, describe_failure
from elastic._shared.storage.location import BucketLocation
from elastic._shared.storage.manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    TENSORS_FILE,
    Candidate,
    Manifest,
    checkpoint_name,
)
from elastic._shared.storage.object_store import bucket_retention
from elastic._shared.storage.object_store.bucket_claim import BucketClaim
from elastic._shared.storage.object_store.objects import ConditionFailed, ObjectMissing, Objects, ObjectTooLarge
from elastic._shared.storage.object_store.transfer import PIECE, BucketChunks, PartUpload

logger = logging.getLogger(__name__)

LATEST = "latest"
CORRUPT = "corrupt"
_STEP = re.compile(r"^step_(\d{8})$")
ATTEMPT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
"""A save attempt's folder name (a saver's tag, a keeper's own)."""


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


class BucketStore:
    """The checkpoints under one bucket prefix: the methods of a directory's `CheckpointStore`
    (directory.py), on a bucket (see the module docstring)."""

    def __init__(self, location: BucketLocation, objects: Objects, *, keep: int = 3, keep_corrupt: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep} must be at least 1")
        self.root = location
        self.objects = objects
        self.keep = keep
        self.keep_corrupt = keep_corrupt
        self._claim = BucketClaim(objects, location.key(WRITER), str(location))
        self._manifests: dict[str, tuple[str, Manifest]] = {}
        """Checkpoint name -> (its manifest's raw text, the manifest) as last read."""
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

    def chunk_source(self, path: Any) -> BucketChunks:
        """Where a restore reads the chunks of the checkpoint at `path` (a committed step's folder)."""
        name = PurePosixPath(str(path)).name
        step = _step_of(name)
        manifest = self._manifest_of(Candidate(name, step, PurePosixPath(str(path))))  # type: ignore[arg-type]
        folder = self.root.key(name, manifest.parts)
        return BucketChunks(self.objects, lambda file: f"{folder}/{validate.need_name(file, 'a shard file')}")

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
        if pointed is not None and _STEP.match(pointed) and pointed > name:
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

    # -- reading ---------------------------------------------------------------------

    def committed(self) -> list[Candidate]:
        """Committed checkpoints (those with a manifest object), newest step first."""
        prefix = self.root.key() + "/" if self.root.prefix else ""
        found: dict[int, Candidate] = {}
        for info in self.objects.list(prefix):
            parts = info.key[len(prefix):].split("/")
            if len(parts) == 2 and parts[1] == MANIFEST and _STEP.match(parts[0]):
                step = int(parts[0][5:])
                found[step] = Candidate(parts[0], step, PurePosixPath(self.root.key(parts[0])))  # type: ignore[arg-type]
        return sorted(found.values(), key=lambda c: c.step, reverse=True)

    def latest_pointer(self) -> str | None:
        try:
            raw, _ = self.objects.get(self.root.key(LATEST), limit=256)
        except (ObjectMissing, ObjectTooLarge):
            return None
        return raw.decode("utf-8", errors="replace").strip() or None

    def _manifest_of(self, candidate: Candidate) -> Manifest:
        """The manifest of `candidate`, read once per process (a commit never changes: only a quarantine
        removes it)."""
        cached = self._manifests.get(candidate.name)
        if cached is not None:
            return cached[1]
        return self.read_manifest(candidate)

    def read_manifest(self, candidate: Candidate) -> Manifest:
        try:
            raw, _ = self.objects.get(self.root.key(candidate.name, MANIFEST), limit=MAX_MANIFEST_BYTES)
        except ObjectMissing:
            raise CorruptCheckpoint(f"{candidate.name} has no {MANIFEST}") from None
        except ObjectTooLarge:
            raise CorruptCheckpoint(f"{candidate.name}/{MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes") from None
        try:
            manifest = Manifest.from_json(raw)
        except CorruptCheckpoint as exc:
            raise CorruptCheckpoint(f"{candidate.name}: {exc}") from None
        if not ATTEMPT.match(manifest.parts):
            raise CorruptCheckpoint(f"{candidate.name}/{MANIFEST} names no upload folder ({manifest.parts[:80]!r})")
        self._manifests[candidate.name] = (raw.decode("utf-8", errors="replace"), manifest)
        if len(self._manifests) > 4096:
            self._manifests.clear()
        return manifest

    def read_checked_manifest(self, candidate: Candidate) -> Manifest:
        manifest = self.read_manifest(candidate)
        if manifest.step != candidate.step:
            raise CorruptCheckpoint(f"{candidate.name}/{MANIFEST} says step {manifest.step}")
        return manifest

    def _file_key(self, candidate: Candidate, file_name: str) -> str:
        manifest = self._manifest_of(candidate)
        return self.root.key(candidate.name, manifest.parts, validate.need_name(file_name, f"{candidate.name} file"))

    def read_file(self, candidate: Candidate, file_name: str, expected: Mapping[str, Any], *, keep: bool = True) -> bytes:
        """The file's bytes (empty unless `keep`), after checking its size and checksum; read in ranges,
        never past the size the manifest gives."""
        key, size = self._file_key(candidate, file_name), int(expected["bytes"])
        where = f"{candidate.name}/{file_name}"
        kept = bytearray(size) if keep else bytearray()
        crc, got = 0, 0
        try:
            for lo in range(0, size, PIECE):
                data = self.objects.get_range(key, lo, min(lo + PIECE, size))
                if keep:
                    kept[lo : lo + len(data)] = data
                crc = crc32c.crc32c(data, crc)
                got += len(data)
                if len(data) < min(PIECE, size - lo):
                    break
            if size == 0:
                self.objects.head(key)
        except ObjectMissing:
            raise CorruptCheckpoint(f"{where} is missing") from None
        if got != size:
            raise CorruptCheckpoint(f"{where} has {got} bytes, the manifest says {size}")
        if "crc32c" in expected and crc != int(expected["crc32c"]):
            raise CorruptCheckpoint(f"{where} fails its crc32c check")
        if "sha256" in expected:  # format 1 (only ever in a directory): never trusted unchecked
            raise CorruptCheckpoint(f"{where} has a sha256 (format 1), which a bucket does not hold")
        return bytes(kept)

    def check_sizes(self, candidate: Candidate, manifest: Manifest) -> None:
        """Every file the manifest names is there with its size (one listing of its folder)."""
        folder = self.root.key(candidate.name, manifest.parts) + "/"
        sizes = {o.key[len(folder):]: o.size for o in self.objects.list(folder)}
        for file_name, expected in manifest.files.items():
            if file_name not in sizes:
                raise CorruptCheckpoint(f"{candidate.name}/{file_name} is missing")
            if sizes[file_name] != int(expected["bytes"]):
                raise CorruptCheckpoint(
                    f"{candidate.name}/{file_name} has {sizes[file_name]} bytes, the manifest says {expected['bytes']}"
                )

    def load_state_file(self, candidate: Candidate, manifest: Manifest, file_name: str, map_location: Any = "cpu") -> Any:
        if file_name not in manifest.files:
            raise CorruptCheckpoint(f"{candidate.name} holds no {file_name}")
        data = self.read_file(candidate, file_name, manifest.files[file_name])
        try:
            return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - a file that checks right but was written wrong
            raise CorruptCheckpoint(f"{candidate.name}/{file_name} does not deserialize: {_first_line(exc)}") from None

    def tensor_metadata(self, candidate: Candidate, manifest: Manifest) -> Any:
        from elastic._shared.storage import sharded

        if TENSORS_FILE not in manifest.files:
            raise CorruptCheckpoint(f"{candidate.name} holds no {TENSORS_FILE}")
        text = self.read_file(candidate, TENSORS_FILE, manifest.files[TENSORS_FILE])
        return sharded.metadata_from_json(text, {name: entry["bytes"] for name, entry in manifest.files.items()})

    def verify(self, candidate: Candidate) -> Manifest:
        """Read and check every byte of a checkpoint (one process); `CorruptCheckpoint` if any fails."""
        from elastic._shared.storage.chunks import read_rows

        manifest = self.read_checked_manifest(candidate)
        self.check_sizes(candidate, manifest)
        for file_name, expected in manifest.files.items():
            if "sha256" in expected or "crc32c" in expected:
                self.read_file(candidate, file_name, expected, keep=False)
        if manifest.format >= 2:
            metadata = self.tensor_metadata(candidate, manifest)
            source = self.chunk_source(candidate.path)
            try:
                items = sorted(metadata.storage_data.items(), key=lambda kv: (kv[1].file, kv[1].offset))
                source.expect([(s.file, s.offset, s.offset + s.length) for _, s in items])
                for index, stored in items:
                    read_rows(PurePosixPath(candidate.name), stored, index.fqn, None, source=source)  # type: ignore[arg-type]
            finally:
                source.close()
        return manifest

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


def _step_of(name: str) -> int:
    if not _STEP.match(name):
        raise CorruptCheckpoint(f"{name[:80]!r} is not a checkpoint's name")
    return int(name[5:])
