"""The on-disk layout of a checkpoint directory, and its commit protocol.

Layout of `--ckpt-dir`:

    step_00000100/            a committed checkpoint: state files + manifest.json
    step_00000150/
    latest                    text file naming the newest committed checkpoint
    writer.json               which job (run id, host, process) writes here (claim.py)
    .tmp.step_00000200.<id>/  a save in progress (or one killed mid-write)
    step_00000150.replaced/   the previous copy of a step being written again
    step_00000050.corrupt/    a checkpoint that failed verification, moved aside

What the state files are is manifest.py's (format 2: sharded.py's tensors and
trainer.pt; format 1: rank 0's model.pt, optimizer.pt and trainer.pt).

Invariants:
- A checkpoint exists only once its directory is renamed from `.tmp.*` to
  `step_XXXXXXXX`: the rename is atomic and happens after every file and the
  manifest are written and fsynced, so a committed directory always holds a
  manifest naming the size and checksum of each file. Readers look only at
  `step_XXXXXXXX` directories; a `.tmp.*` directory is never loaded.
- Committing goes through `finish` (commit.py builds what it commits), after
  the claim is checked: whoever commits a step, rank 0 or a snapshot keeper,
  commits it the same way.
- Two writers committing the same step at once (rank 0's final save and a
  keeper's persist of that step, say) is not a failure: the one whose rename
  finds the step there verifies that copy and discards its own.
- Committing a step that is committed already (one writer after another)
  replaces it: the old copy is renamed to `step_N.replaced` first, so until
  the new copy is renamed in, the old one is still found (and put back by
  `prepare` after a crash), and no moment exists where a crash loses both.
- `latest` is replaced atomically after the commit and never moves back to an
  older step. `committed()` reads it before listing the directory and adds the
  checkpoint it names even when the listing misses it (an NFS client's
  directory cache can hide a fresh `step_N` for tens of seconds); it is not
  trusted otherwise: the newest committed directory that verifies wins.
- At most `keep_corrupt` quarantined `.corrupt` directories stay (the newest).
- A save that fails (full disk, quota, I/O error) removes its own `.tmp.*`
  directory and raises `SaveFailed` naming the cause in one line; nothing
  committed is touched. A failure after the rename (updating `latest`) is a
  warning: the checkpoint is committed.
- Older checkpoints are deleted only after a newer one is committed, only
  while the claim is still the committer's (or its job's, for a keeper), and
  only behind the newest `keep` that verify and belong to the committing run
  (retention.py): a directory that does not verify, or another run's, never
  counts towards `keep`, and one that has no readable manifest is never deleted.
- Reading is directory_reader.py's: a manifest, tensors.json and `latest` are
  untrusted input (a `CorruptCheckpoint`, so the restore falls back to an
  older checkpoint), and nothing loads pickled code.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import crc32c

from elastic._shared.common.errors import CheckpointStorageError, CorruptCheckpoint
from elastic._shared.storage import claim as claims
from elastic._shared.storage import retention
from elastic._shared.storage.claim import WriterIdentity
from elastic._shared.storage.directory_reader import COMMITTED, LATEST, REPLACED, DirectoryReader
from elastic._shared.storage.durable import (
    TMP_PREFIX,
    SaveFailed,
    describe_failure,
    fsync_dir,
    replace_small,
    save_durably,
    write_bytes_durably,
)
from elastic._shared.storage.manifest import MANIFEST, Candidate, Manifest, checkpoint_name

logger = logging.getLogger(__name__)

CORRUPT_SUFFIX = ".corrupt"
_RACED = {errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT}
"""What a rename meets when another writer publishes the same step at the same moment."""


def _mb(size: int) -> str:
    return f"{size / 2**20:.1f} MB"


class CheckpointStore(DirectoryReader):
    """One checkpoint directory: claim, commit, retire and quarantine; listing, verifying and loading
    are `DirectoryReader`'s (directory_reader.py)."""

    def __init__(self, directory: str | os.PathLike[str], *, keep: int = 3, keep_corrupt: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep} must be at least 1")
        super().__init__(directory)
        self.keep = keep
        self.keep_corrupt = keep_corrupt

    # -- ownership -----------------------------------------------------------

    def prepare(self, identity: WriterIdentity | None = None) -> None:
        """Create the directory, claim it for `identity`, put back a copy a crash left
        replaced, remove saves that died before their commit, and check a write gets
        through (`CheckpointStorageError` naming the cause if not)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointStorageError(f"cannot create checkpoint directory {self.root}: {exc.strerror}") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise CheckpointStorageError(f"checkpoint directory {self.root} is not writable")
        if identity is not None:
            self.claim(identity)
        self._recover_replaced()
        for stale in self.root.glob(TMP_PREFIX + "*"):
            logger.info("removing %s: a save that never committed", stale.name)
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:  # the `latest` pointer's new copy, killed before its rename (rmtree leaves a file)
                stale.unlink(missing_ok=True)
        self._probe()

    def writer(self) -> WriterIdentity | None:
        """Who claimed the directory last (None: nobody, or an unreadable claim)."""
        return claims.current(self.root)

    def claim(self, identity: WriterIdentity) -> None:
        """Make `identity` the directory's writer; `CheckpointStorageError` if another live job writes here."""
        claims.claim(self.root, identity)

    def heartbeat(self, identity: WriterIdentity) -> None:
        """Refresh the claim (a job that saves rarely still looks alive); `SaveFailed` if it was lost."""
        claims.refresh(self.root, identity)

    def release(self, identity: WriterIdentity) -> None:
        claims.release(self.root, identity)  # the job ended: its claim's heartbeat goes to 0

    def check_owner(self, identity: WriterIdentity) -> None:
        """`SaveFailed` unless the directory is still this writer's (another job or a newer rank 0 took it)."""
        claims.check_may_commit(self.root, identity.run_id, identity)

    def _probe(self) -> None:
        """Write, fsync and remove a small file: a read-only or failing filesystem is
        found before training rather than at the first save."""
        probe = self.root / f"{TMP_PREFIX}probe.{uuid.uuid4().hex[:8]}"
        try:
            with open(probe, "wb") as f:
                f.write(b"\0" * 4096)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise CheckpointStorageError(
                f"checkpoint directory {self.root} refuses writes: {describe_failure(exc)}"
            ) from None
        finally:
            probe.unlink(missing_ok=True)

    def check_room(self, needed_bytes: int) -> None:
        """`CheckpointStorageError` unless `needed_bytes` (a checkpoint's size) fit in the free space."""
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            return  # no statistics from this filesystem: the save will tell
        if free < needed_bytes:
            raise CheckpointStorageError(
                f"checkpoint directory {self.root} has {_mb(free)} free, a checkpoint takes {_mb(needed_bytes)}: "
                "free space or point --ckpt-dir at a larger volume"
            )

    # -- writing -------------------------------------------------------------

    def begin(self, step: int, tag: str) -> Path:
        """The temporary directory of a save of `step` (every rank of the save writes into it)."""
        return self.root / f"{TMP_PREFIX}{checkpoint_name(step)}.{tag}"

    def write_bytes(self, tmp: Path, file_name: str, data: bytes) -> dict[str, Any]:
        """`data` into `tmp/file_name`, fsynced; its size and crc32c."""
        write_bytes_durably(tmp / file_name, data)
        return {"bytes": len(data), "crc32c": crc32c.crc32c(data)}

    def write_state_file(self, tmp: Path, file_name: str, obj: Any) -> dict[str, Any]:
        """`obj` saved with torch.save into `tmp/file_name`, fsynced; its size and crc32c."""
        tmp.mkdir(parents=True, exist_ok=True)
        writer = save_durably(tmp / file_name, obj, sha256=False)
        return {"bytes": writer.bytes, "crc32c": writer.crc32c}

    def finish(
        self,
        tmp: Path,
        manifest: Manifest,
        *,
        owner: WriterIdentity | None = None,
        before_commit: Callable[[], None] = lambda: None,
    ) -> Path:
        """Write the manifest into `tmp` and commit it as checkpoint `manifest.step`, atomically.

        `before_commit` runs after everything is durable but before the rename
        (fault injection dies there). The claim is checked just before the
        rename (`claim.check_may_commit`): with an `owner` (rank 0), it must
        still be that writer's; without one (a keeper), its job's
        (`manifest.run_id`). A refused commit is `SaveFailed`. A failure before
        the rename removes `tmp`; nothing committed is touched. When another
        writer commits the same step at the same moment and its copy verifies,
        `tmp` is discarded and that copy is the commit.
        """
        name = checkpoint_name(manifest.step)
        try:
            write_bytes_durably(tmp / MANIFEST, manifest.to_json().encode("utf-8"))
            fsync_dir(tmp)
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise SaveFailed(f"cannot write {name} to {self.root}: {describe_failure(exc)}") from exc
        before_commit()
        try:
            claims.check_may_commit(self.root, manifest.run_id, owner)
        except SaveFailed:
            shutil.rmtree(tmp, ignore_errors=True)  # ours; the new writer's temporaries are left alone
            raise
        return self._publish(tmp, manifest.step, owner, manifest.run_id)

    def abort(self, tmp: Path) -> None:
        """Remove a save that failed before its commit."""
        shutil.rmtree(tmp, ignore_errors=True)

    def commit(
        self,
        step: int,
        files: Mapping[str, Any],
        *,
        describe: Callable[[dict[str, dict[str, Any]]], Manifest],
        before_commit: Callable[[], None] = lambda: None,
        mid_write: Callable[[], None] = lambda: None,
    ) -> Path:
        """Write `files` (name -> object for torch.save) as a format-1 checkpoint `step`, atomically.

        The format torchrevive 0.1 wrote from rank 0 (sha256 per file); kept
        so tools and tests can make such checkpoints. `describe` builds the
        manifest from the written files' digests; `mid_write` runs after the first file.
        """
        name = checkpoint_name(step)
        tmp = self.root / f"{TMP_PREFIX}{name}.{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir()
            digests: dict[str, dict[str, Any]] = {}
            for file_name, obj in files.items():
                writer = save_durably(tmp / file_name, obj, sha256=True)
                digests[file_name] = {"sha256": writer.sha256.hexdigest(), "bytes": writer.bytes}
                if len(digests) == 1:
                    mid_write()
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise SaveFailed(f"cannot write {name} to {self.root}: {describe_failure(exc)}") from exc
        manifest = describe(digests)
        return self.finish(tmp, Manifest(**{**manifest.__dict__, "format": 1}), before_commit=before_commit)

    def _publish(self, tmp: Path, step: int, owner: WriterIdentity | None, run_id: str) -> Path:
        """Rename `tmp` to the step's name; a copy already there stays findable until the new one
        is in. Losing a race to another writer of the same step is no failure when its copy verifies."""
        name = checkpoint_name(step)
        final = self.root / name
        try:
            if final.exists():
                # A crash between these renames leaves step_N.replaced, which committed()
                # still lists and prepare() puts back: there is never a moment without a copy.
                replaced = self.root / f"{name}.replaced"
                shutil.rmtree(replaced, ignore_errors=True)
                os.rename(final, replaced)
                os.rename(tmp, final)
                shutil.rmtree(replaced, ignore_errors=True)
            else:
                os.rename(tmp, final)
        except OSError as exc:
            # Another writer (rank 0 or a keeper) published this step between our look and our rename.
            if exc.errno not in _RACED or not final.is_dir() or not self._verifies(name, step, final):
                raise
            logger.info("%s was committed by another writer meanwhile and verifies; this copy goes", name)
            shutil.rmtree(tmp, ignore_errors=True)
        # Committed. What follows is housekeeping: a failure there is a warning, not a failed save.
        try:
            fsync_dir(self.root)
            self._write_latest(name)
            if owner is not None:
                claims.refresh_after_commit(self.root, owner)
        except OSError as exc:
            logger.warning("%s committed, but updating %s failed: %s", name, LATEST, describe_failure(exc))
        retention.mark_verified(final)  # this writer's own commit, or another's that `_verifies` checked
        retention.retire_old(self, run_id, owner)
        return final

    def _verifies(self, name: str, step: int, path: Path) -> bool:
        try:
            self.verify(Candidate(name, step, path))
        except CorruptCheckpoint as exc:
            logger.warning("%s was committed by another writer but does not verify: %s", name, exc)
            return False
        return True

    def _write_latest(self, name: str) -> None:
        """Point `latest` at `name`, unless it already names a newer step (it never moves back)."""
        pointed = self.latest_pointer()
        if pointed is not None and COMMITTED.match(pointed) and pointed > name and (self.root / pointed).is_dir():
            return
        replace_small(self.root, LATEST, name + "\n")

    def _recover_replaced(self) -> None:
        """A crash between the two renames of `_publish`: put the old copy back (or drop it)."""
        for entry in self.root.iterdir():
            match = REPLACED.match(entry.name)
            if not match:
                continue
            final = self.root / checkpoint_name(int(match.group(1)))
            if final.exists():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                logger.warning("putting back %s: a save that replaced it died before its commit", final.name)
                os.rename(entry, final)

    def quarantine(self, candidate: Candidate) -> Path:
        """Move a checkpoint that failed verification aside for a post-mortem; only the
        newest `keep_corrupt` quarantined ones are kept, so they never fill the disk."""
        target = self.root / f"{candidate.name}{CORRUPT_SUFFIX}"
        if target.exists():
            target = self.root / f"{candidate.name}{CORRUPT_SUFFIX}.{int(time.time())}"
        os.rename(candidate.path, target)
        # A rename keeps the directory's mtime (when it was written): make it say when it was quarantined,
        # or a restore that quarantines the newest step first would delete each older one at once.
        os.utime(target)
        fsync_dir(self.root)
        quarantined = sorted(
            (p for p in self.root.iterdir() if CORRUPT_SUFFIX in p.name and p.is_dir()),
            key=lambda p: (p.stat().st_mtime_ns, p == target),
            reverse=True,
        )
        for old in quarantined[self.keep_corrupt :]:
            logger.info("deleting %s (keeping the newest %d corrupt checkpoints)", old.name, self.keep_corrupt)
            shutil.rmtree(old, ignore_errors=True)
        return target
