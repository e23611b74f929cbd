"""Checks for what a peer, a disk or a restart hands us: JSON documents, names, file reads.

Everything in a checkpoint or a snapshot part that was not made by this
process is parsed through these helpers (parts.py, manifest.py, sharded.py,
chunks.py, directory.py).

Invariants:
- Every malformed input is a `CorruptCheckpoint` of one line naming what is
  wrong; never a TypeError, KeyError, MemoryError or RecursionError, so a
  caller falls back to the next source instead of crashing.
- Integers are JSON integers (not bools, not floats) within [lo, `MAX_INT`]:
  every size and offset fits an int64, so torch.Size and arithmetic on them
  never overflow.
- A file name is a bare name (`BARE_NAME`: no '/', no '..', not hidden), so a
  document can only name files inside its own directory.
- A file is read only once it is known to be a regular file (a FIFO, a device
  such as /dev/zero, a directory are refused without blocking), and never more
  than its size on disk or a stated limit: a declared length never becomes an
  allocation larger than the file.
- A symbolic link is not followed (`O_NOFOLLOW`, `lstat`): a name in a document
  reads only the file of that name in its directory, never one a link put there
  points at. Only a caller reading links it laid out itself (a restore's parts,
  memory.gather_files) passes `follow_link=True`.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from elastic._shared.common.errors import CorruptCheckpoint

MAX_INT = 2**62
"""The largest size, offset or step accepted: far beyond any file, and safe in an int64."""
UINT32 = 2**32
BARE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
"""A file name inside a checkpoint or part directory: never a path, never '.' or '..'."""
MAX_TEXT = 4096
"""The longest free-form string accepted (a run id, a reason, a directory, a tensor's key)."""


def parse_json(raw: bytes | str, what: str, limit: int) -> dict[str, Any]:
    """The JSON object in `raw` (at most `limit` bytes); `CorruptCheckpoint` for anything else."""
    if len(raw) > limit:
        raise CorruptCheckpoint(f"{what} is {len(raw)} bytes, more than the {limit} it may be")
    try:
        data = json.loads(raw)
    except RecursionError:
        raise CorruptCheckpoint(f"{what} is nested too deeply") from None
    except (ValueError, TypeError) as exc:  # JSONDecodeError, UnicodeDecodeError, too many digits
        raise CorruptCheckpoint(f"{what} is not JSON: {str(exc)[:200]}") from None
    return need_dict(data, what)


def need_dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CorruptCheckpoint(f"{what} is a {type(value).__name__}, not an object")
    return value


def need_key(raw: Mapping[str, Any], key: str, what: str) -> Any:
    if key not in raw:
        raise CorruptCheckpoint(f"{what} has no {key!r}")
    return raw[key]


def need_list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise CorruptCheckpoint(f"{what} is a {type(value).__name__}, not a list")
    return value


def need_int(value: Any, what: str, lo: int = 0, hi: int = MAX_INT) -> int:
    """`value` if it is an int (not a bool) in [lo, hi]."""
    if type(value) is not int:
        raise CorruptCheckpoint(f"{what} is {_show(value)}, not an integer")
    if not lo <= value <= hi:
        raise CorruptCheckpoint(f"{what} is {value}, outside {lo}..{hi}")
    return value


def need_ints(value: Any, what: str, lo: int = 0, hi: int = MAX_INT) -> tuple[int, ...]:
    return tuple(need_int(v, f"{what}[{i}]", lo, hi) for i, v in enumerate(need_list(value, what)))


def need_float(value: Any, what: str) -> float:
    """A finite number (an int counts)."""
    if type(value) not in (int, float) or not math.isfinite(value):
        raise CorruptCheckpoint(f"{what} is {_show(value)}, not a finite number")
    return float(value)


def need_str(value: Any, what: str, *, max_len: int = MAX_TEXT, pattern: re.Pattern[str] | None = None) -> str:
    """A string of at most `max_len` characters without control characters, matching `pattern`."""
    if not isinstance(value, str):
        raise CorruptCheckpoint(f"{what} is {_show(value)}, not a string")
    if len(value) > max_len:
        raise CorruptCheckpoint(f"{what} is {len(value)} characters long, more than {max_len}")
    if pattern is not None and not pattern.match(value):
        raise CorruptCheckpoint(f"{what} {value[:80]!r} is not of the form {pattern.pattern}")
    if not value.isprintable():
        raise CorruptCheckpoint(f"{what} {value[:80]!r} holds control characters")
    return value


def need_name(value: Any, what: str) -> str:
    """A bare file name (`BARE_NAME`): it can only name a file in the document's own directory."""
    name = need_str(value, what, max_len=128)
    if not BARE_NAME.match(name):
        raise CorruptCheckpoint(f"{what} {name[:80]!r} is not a plain file name in its directory")
    return name


def _show(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (bool, type(None))) else repr(value)
    return text if len(text) <= 40 else f"a {type(value).__name__}"


# -- files -----------------------------------------------------------------------------


def open_regular(path: Path, what: str, *, follow_link: bool = False) -> BinaryIO:
    """`path` opened for reading if it is a regular file; `CorruptCheckpoint` for a FIFO, a
    device, a directory, without blocking on any of them, and for a symbolic link unless
    `follow_link` (then its target must be a regular file). `FileNotFoundError` if it is
    missing, another `OSError` if it cannot be opened."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags if follow_link else flags | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_link:
            raise CorruptCheckpoint(f"{what} is a symbolic link, not a regular file") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptCheckpoint(f"{what} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def regular_size(path: Path, what: str) -> int:
    """The size of `path` (by lstat: a symbolic link is not followed) if it is a regular file,
    inside its directory (a bare name); `CorruptCheckpoint` otherwise, `FileNotFoundError` if missing."""
    need_name(path.name, what)
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        raise CorruptCheckpoint(f"{what} is a symbolic link, not a regular file")
    if not stat.S_ISREG(info.st_mode):
        raise CorruptCheckpoint(f"{what} is not a regular file")
    return info.st_size


def file_size(f: BinaryIO) -> int:
    return os.fstat(f.fileno()).st_size


def read_bounded(path: Path, what: str, limit: int) -> bytes:
    """The whole of the regular file `path`, refused (`CorruptCheckpoint`) beyond `limit` bytes."""
    with open_regular(path, what) as f:
        size = file_size(f)
        if size > limit:
            raise CorruptCheckpoint(f"{what} is {size} bytes, more than the {limit} it may be")
        data = f.read(limit + 1)  # a file growing meanwhile is still read only to the limit
    if len(data) > limit:
        raise CorruptCheckpoint(f"{what} is more than the {limit} bytes it may be")
    return data
