"""Writing files so that a crash leaves either the old or the new one, whole.

Invariants:
- A state file is written through `save_durably` (fsynced before it returns);
  a small control file (`latest`, `writer.json`) is replaced atomically by
  `replace_small` (temporary file, fsync, rename, fsync of the directory).
- A failed write raises the OS error behind it (ENOSPC, EDQUOT, EIO), which
  `describe_failure` turns into one line; torch's zip writer alone would hide
  it behind a RuntimeError that names no cause.
"""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import crc32c
import torch

logger = logging.getLogger(__name__)

TMP_PREFIX = ".tmp."
"""Names starting so are never a checkpoint: saves in progress and temporary files."""

# fsync on a directory is refused by some filesystems (FUSE, 9p, CIFS, some NFS
# clients). The files themselves are fsynced; the rename is then as durable as
# that filesystem can make it, which beats refusing every save on it.
_DIR_FSYNC_UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EISDIR}
_dir_fsync_warned = False


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


def fsync_dir(path: Path) -> None:
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


class _HashingWriter:
    """A write-only file object that hashes and counts what passes through it.

    It keeps the first OSError a write raised: torch's zip writer reports a
    failed write (ENOSPC, EIO, EDQUOT) as a RuntimeError that names no cause.
    """

    def __init__(self, raw: io.BufferedWriter, *, sha256: bool = True) -> None:
        self._raw = raw
        self.sha256 = hashlib.sha256() if sha256 else None
        self.crc32c = 0
        self.bytes = 0
        self.error: OSError | None = None

    def write(self, data: bytes | memoryview) -> int:
        if self.sha256 is not None:
            self.sha256.update(data)
        else:
            self.crc32c = crc32c.crc32c(data, self.crc32c)
        self.bytes += len(data)
        try:
            return self._raw.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self._raw.flush()


def save_durably(path: Path, obj: Any, *, sha256: bool) -> _HashingWriter:
    """torch.save `obj` to `path` through a hashing writer, fsynced; raises the OS error behind
    a failed write (torch's zip writer hides it behind a RuntimeError)."""
    with open(path, "wb") as raw:
        writer = _HashingWriter(raw, sha256=sha256)
        try:
            torch.save(obj, writer)
            raw.flush()
        except Exception as exc:
            if writer.error is not None and writer.error is not exc:
                raise writer.error from None
            raise
        os.fsync(raw.fileno())
    return writer


def write_bytes_durably(path: Path, data: bytes) -> None:
    """`data` into `path`, fsynced."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_small(directory: Path, file_name: str, text: str) -> None:
    """Replace `directory/file_name` with `text` atomically (temporary file, fsync, rename)."""
    tmp = directory / f"{TMP_PREFIX}{file_name}.{uuid.uuid4().hex[:8]}"
    try:
        write_bytes_durably(tmp, text.encode("utf-8"))
        os.replace(tmp, directory / file_name)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(directory)
