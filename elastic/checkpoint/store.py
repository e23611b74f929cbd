"""The on-disk format of a checkpoint directory, and its commit protocol.

Layout of `--ckpt-dir`:

    step_00000100/            a committed checkpoint: state files + manifest.json
    step_00000150/
    latest                    text file naming the newest committed checkpoint
    .tmp.step_00000200.<id>/  a save in progress (or one killed mid-write)
    step_00000050.corrupt/    a checkpoint that failed verification, moved aside

Invariants:
- A checkpoint exists only once its directory is renamed from `.tmp.*` to
  `step_XXXXXXXX`: the rename is atomic and happens after every file and the
  manifest are written and fsynced, so a committed directory always holds a
  manifest naming the sha256 and size of each file. Readers look only at
  `step_XXXXXXXX` directories; a `.tmp.*` directory is never loaded.
- `latest` is replaced atomically (write a temporary file, fsync, rename) after
  the commit; it is a convenience for people and tools. Loading does not trust
  it: the newest committed directory that verifies wins.
- A save that fails (full disk, quota, I/O error) removes its own `.tmp.*`
  directory and raises `SaveFailed` naming the cause in one line; nothing
  committed is touched. A failure after the rename (updating `latest`) is a
  warning: the checkpoint is committed.
- Older checkpoints are deleted only after a newer one is committed, and the
  newest `keep` committed ones always remain.
- State files load with `torch.load(weights_only=True)`: no pickled code runs.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import elastic
from elastic.errors import CheckpointStorageError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
_COMMITTED = re.compile(r"^step_(\d{8})$")
_TMP_PREFIX = ".tmp."
CORRUPT_SUFFIX = ".corrupt"
_READ_CHUNK = 8 * 2**20


def _mb(size: int) -> str:
    return f"{size / 2**20:.1f} MB"


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


# fsync on a directory is refused by some filesystems (FUSE, 9p, CIFS, some NFS
# clients). The files themselves are fsynced; the rename is then as durable as
# that filesystem can make it, which beats refusing every save on it.
_DIR_FSYNC_UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EISDIR}
_dir_fsync_warned = False


def _fsync_dir(path: Path) -> None:
    global _dir_fsync_warned
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _DIR_FSYNC_UNSUPPORTED:
            raise
        if not _dir_fsync_warned:
            _dir_fsync_warned = True
            logger.warning("%s: the filesystem refuses fsync on a directory (%s); committing without it", path, exc.strerror)
    finally:
        os.close(fd)


class SaveFailed(Exception):
    """A save that could not be written (full disk, quota, I/O error, permissions);
    its message is one line naming the cause. Nothing committed was touched."""


def describe_failure(exc: BaseException) -> str:
    """One line for what went wrong in a save: the errno's text for OS errors."""
    if isinstance(exc, OSError):
        name = errno.errorcode.get(exc.errno or 0, "")
        text = exc.strerror or str(exc)
        where = f": {exc.filename}" if exc.filename else ""
        return f"{text} ({name}){where}" if name else f"{text}{where}"
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"


class _HashingWriter:
    """A write-only file object that hashes and counts what passes through it.

    It keeps the first OSError a write raised: torch's zip writer reports a
    failed write (ENOSPC, EIO, EDQUOT) as a RuntimeError that names no cause.
    """

    def __init__(self, raw: io.BufferedWriter) -> None:
        self._raw = raw
        self.sha256 = hashlib.sha256()
        self.bytes = 0
        self.error: OSError | None = None

    def write(self, data: bytes | memoryview) -> int:
        self.sha256.update(data)
        self.bytes += len(data)
        try:
            return self._raw.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self._raw.flush()


@dataclass(frozen=True)
class Manifest:
    """What a committed checkpoint holds; stored as manifest.json beside the files."""

    step: int
    epoch: int
    consumed: int
    world_size: int
    files: dict[str, dict[str, Any]]
    """file name -> {"sha256": hex digest, "bytes": size}"""
    created: float
    reason: str
    run_id: str
    versions: dict[str, str]

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT_VERSION, **self.__dict__}, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        raw = json.loads(text)
        if raw.get("format") != FORMAT_VERSION:
            raise ValueError(f"manifest format {raw.get('format')!r}, this runtime reads {FORMAT_VERSION}")
        return cls(
            step=int(raw["step"]), epoch=int(raw["epoch"]), consumed=int(raw["consumed"]),
            world_size=int(raw["world_size"]), files=dict(raw["files"]), created=float(raw["created"]),
            reason=str(raw["reason"]), run_id=str(raw["run_id"]), versions=dict(raw["versions"]),
        )

    @property
    def total_bytes(self) -> int:
        return sum(int(f["bytes"]) for f in self.files.values())


def versions() -> dict[str, str]:
    return {
        "elastic": elastic.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }


class CorruptCheckpoint(Exception):
    """A committed checkpoint whose manifest or files do not verify."""


@dataclass(frozen=True)
class Candidate:
    name: str
    step: int
    path: Path


class CheckpointStore:
    """One checkpoint directory: commit, list, verify, load, retire."""

    def __init__(self, directory: str | os.PathLike[str], *, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep} must be at least 1")
        self.root = Path(directory)
        self.keep = keep

    # -- writing -------------------------------------------------------------

    def prepare(self) -> None:
        """Create the directory, remove saves that died before their commit, and check a
        write gets through (`CheckpointStorageError` naming the cause if not)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointStorageError(f"cannot create checkpoint directory {self.root}: {exc.strerror}") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise CheckpointStorageError(f"checkpoint directory {self.root} is not writable")
        for stale in self.root.glob(_TMP_PREFIX + "*"):
            logger.info("removing %s: a save that never committed", stale.name)
            shutil.rmtree(stale, ignore_errors=True)
        self._probe()

    def _probe(self) -> None:
        """Write, fsync and remove a small file: a read-only or failing filesystem is
        found before training rather than at the first save."""
        probe = self.root / f"{_TMP_PREFIX}probe.{uuid.uuid4().hex[:8]}"
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

    def commit(
        self,
        step: int,
        files: Mapping[str, Any],
        *,
        describe: Callable[[dict[str, dict[str, Any]]], Manifest],
        before_commit: Callable[[], None] = lambda: None,
        mid_write: Callable[[], None] = lambda: None,
    ) -> Path:
        """Write `files` (name -> object for torch.save) as checkpoint `step`, atomically.

        `describe` builds the manifest from the written files' digests;
        `before_commit` runs after everything is durable but before the rename
        (fault injection uses it to die at the worst moment); `mid_write` after
        the first file is written (it injects storage faults).
        """
        name = checkpoint_name(step)
        tmp = self.root / f"{_TMP_PREFIX}{name}.{uuid.uuid4().hex[:8]}"
        try:
            self._write_files(tmp, files, describe, mid_write)
        except Exception as exc:
            # Nothing was committed: the save's own directory goes, the older checkpoints stay.
            shutil.rmtree(tmp, ignore_errors=True)
            raise SaveFailed(f"cannot write {name} to {self.root}: {describe_failure(exc)}") from exc
        before_commit()

        final = self.root / name
        if final.exists():
            # The same step committed by an earlier attempt: retire it only now
            # that its replacement is complete, so there is never a moment without one.
            retired = self.root / f"{_TMP_PREFIX}{name}.replaced.{uuid.uuid4().hex[:8]}"
            os.rename(final, retired)
            os.rename(tmp, final)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.rename(tmp, final)
        # Committed. What follows is housekeeping: a failure there is a warning, not a failed save.
        try:
            _fsync_dir(self.root)
            self._write_latest(name)
        except OSError as exc:
            logger.warning("%s committed, but updating %s failed: %s", name, LATEST, describe_failure(exc))
        self._retire_old()
        return final

    def _write_files(
        self,
        tmp: Path,
        files: Mapping[str, Any],
        describe: Callable[[dict[str, dict[str, Any]]], Manifest],
        mid_write: Callable[[], None],
    ) -> None:
        """Every file and the manifest into `tmp`, each fsynced; raises the first OS error."""
        tmp.mkdir()
        digests: dict[str, dict[str, Any]] = {}
        for file_name, obj in files.items():
            with open(tmp / file_name, "wb") as raw:
                writer = _HashingWriter(raw)
                try:
                    torch.save(obj, writer)
                    raw.flush()
                except Exception as exc:
                    if writer.error is not None and writer.error is not exc:
                        raise writer.error from None  # the cause torch's error hides
                    raise
                os.fsync(raw.fileno())
            digests[file_name] = {"sha256": writer.sha256.hexdigest(), "bytes": writer.bytes}
            if len(digests) == 1:
                mid_write()
        manifest = describe(digests)
        with open(tmp / MANIFEST, "w", encoding="utf-8") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)

    def _write_latest(self, name: str) -> None:
        tmp = self.root / f"{_TMP_PREFIX}{LATEST}.{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(name + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.root / LATEST)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(self.root)

    def _retire_old(self) -> None:
        for old in self.committed()[self.keep :]:
            shutil.rmtree(old.path, ignore_errors=True)
            logger.debug("deleted %s (keeping the newest %d)", old.name, self.keep)

    # -- reading -------------------------------------------------------------

    def committed(self) -> list[Candidate]:
        """Committed checkpoints, newest step first."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            match = _COMMITTED.match(entry.name)
            if match and entry.is_dir():
                found.append(Candidate(entry.name, int(match.group(1)), entry))
        return sorted(found, key=lambda c: c.step, reverse=True)

    def latest_pointer(self) -> str | None:
        try:
            return (self.root / LATEST).read_text(encoding="utf-8").strip() or None
        except FileNotFoundError:
            return None

    def read_manifest(self, candidate: Candidate) -> Manifest:
        try:
            return Manifest.from_json((candidate.path / MANIFEST).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{candidate.name} has no {MANIFEST}") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpoint(f"{candidate.name}/{MANIFEST} is unreadable: {exc}") from None

    def _read_checked_manifest(self, candidate: Candidate) -> Manifest:
        manifest = self.read_manifest(candidate)
        if manifest.step != candidate.step:
            raise CorruptCheckpoint(f"{candidate.name}/{MANIFEST} says step {manifest.step}")
        return manifest

    def _check_file(self, candidate: Candidate, file_name: str, expected: Mapping[str, Any], *, keep: bool) -> bytes:
        """The file's bytes (empty unless `keep`), after checking its size and sha256.

        A file not kept is hashed in chunks, so checking a large one costs no memory.
        """
        digest, size, data = hashlib.sha256(), 0, b""
        try:
            with open(candidate.path / file_name, "rb") as f:
                if keep:
                    data = f.read()
                    digest.update(data)
                    size = len(data)
                else:
                    while chunk := f.read(_READ_CHUNK):
                        digest.update(chunk)
                        size += len(chunk)
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{candidate.name}/{file_name} is missing") from None
        if size != int(expected["bytes"]):
            raise CorruptCheckpoint(f"{candidate.name}/{file_name} has {size} bytes, the manifest says {expected['bytes']}")
        if digest.hexdigest() != expected["sha256"]:
            raise CorruptCheckpoint(f"{candidate.name}/{file_name} fails its sha256 check")
        return data

    def read_verified(self, candidate: Candidate) -> tuple[Manifest, dict[str, bytes]]:
        """The manifest and every file's bytes, each checked against its sha256 and size."""
        manifest = self._read_checked_manifest(candidate)
        contents = {
            file_name: self._check_file(candidate, file_name, expected, keep=True)
            for file_name, expected in manifest.files.items()
        }
        return manifest, contents

    def verify(self, candidate: Candidate) -> Manifest:
        """Raise `CorruptCheckpoint` unless every file matches the manifest."""
        manifest, _ = self.read_verified(candidate)
        return manifest

    def load(self, candidate: Candidate, map_location: torch.device | str) -> tuple[Manifest, dict[str, Any]]:
        """Verify, then deserialize every file with weights_only=True onto `map_location`."""
        manifest, contents = self.read_verified(candidate)
        state = {}
        for file_name, data in contents.items():
            try:
                state[file_name] = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
            except Exception as exc:  # a file that hashes right but was written wrong
                raise CorruptCheckpoint(f"{candidate.name}/{file_name} does not deserialize: {exc}") from None
        return manifest, state

    def load_file(
        self, candidate: Candidate, file_name: str, map_location: torch.device | str
    ) -> tuple[Manifest, Any]:
        """Verify every file like `load`, then deserialize only `file_name` (weights_only=True).

        The other files are hashed but never held in memory or unpickled, so a reader
        that needs the model alone skips the optimizer's cost; a checkpoint any of whose
        files fails its check is refused, as `load` would refuse it. The bytes that are
        deserialized are the very bytes that were hashed, never a second read.
        """
        manifest = self._read_checked_manifest(candidate)
        if file_name not in manifest.files:
            raise CorruptCheckpoint(f"{candidate.name} holds no {file_name}")
        data = b""
        for name, expected in manifest.files.items():
            content = self._check_file(candidate, name, expected, keep=name == file_name)
            if name == file_name:
                data = content
        try:
            return manifest, torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
        except Exception as exc:  # a file that hashes right but was written wrong
            raise CorruptCheckpoint(f"{candidate.name}/{file_name} does not deserialize: {exc}") from None

    def quarantine(self, candidate: Candidate) -> Path:
        """Move a checkpoint that failed verification aside, keeping it for a post-mortem."""
        target = self.root / f"{candidate.name}{CORRUPT_SUFFIX}"
        if target.exists():
            target = self.root / f"{candidate.name}{CORRUPT_SUFFIX}.{int(time.time())}"
        os.rename(candidate.path, target)
        _fsync_dir(self.root)
        return target
