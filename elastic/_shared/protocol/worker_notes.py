"""What a worker leaves for its agent on the node: its last completed step, a named hang, the event log's path.

The agent (torchrevive-run) makes a private directory per node and names it in `NOTES_ENV` for its
workers. A worker writes there:

- `progress-LOCALRANK`: its last completed step, rewritten in place at every step (16 bytes:
  `MAGIC` and the step; one `pwrite`, no allocation), so that the agent can say at which step a worker
  died even when the worker could not say it (SIGKILL, the OOM killer);
- `hang-LOCALRANK`: the verdict of a stall this worker's comparison won (elastic._worker.control.hang_names),
  one JSON object;
- `events`: the job's event log path, written by the worker that holds the log (rank 0), so that
  this node's agent can append the job-level events (`failure`, `hang`, `node_excluded`,
  `crash_loop`) to the same file.

The agent writes one note for its workers: `incidents`, the job's counts of failures, named hangs and
nodes set aside as it has read them, which the workers' metrics serve (`read_incidents`).

Invariants: every read is bounded (`MAX_NOTE` bytes), takes no lock and never blocks (a regular file,
opened without following a link); what it returns is checked (the magic and a step of 0 or more; a JSON
object; a path of printable text) or None. Notes are replaced whole (a temporary file renamed over the
old one), except the progress record, whose 16 bytes are written with one `pwrite`.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path
from typing import Any

NOTES_ENV = "TORCHREVIVE_WORKER_NOTES"
"""The directory of this node's notes (set by the agent; unset: no notes are written)."""
MAGIC = 0x5452564E  # "TRVN"
MAX_NOTE = 8192
_PROGRESS = struct.Struct("<IIq")  # magic, reserved, step


def progress_path(directory: str | os.PathLike[str], local_rank: int) -> Path:
    return Path(directory) / f"progress-{local_rank}"


def hang_path(directory: str | os.PathLike[str], local_rank: int) -> Path:
    return Path(directory) / f"hang-{local_rank}"


def events_path_note(directory: str | os.PathLike[str]) -> Path:
    return Path(directory) / "events"


class ProgressNote:
    """A worker's last completed step in its agent's notes (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str], local_rank: int) -> None:
        self._fd = os.open(progress_path(directory, local_rank), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)

    def write(self, step: int) -> None:
        try:
            os.pwrite(self._fd, _PROGRESS.pack(MAGIC, 0, step), 0)
        except OSError:
            pass  # a note, not state: a full or vanished directory must not stop training

    def close(self) -> None:
        os.close(self._fd)


def for_worker(environ: Any) -> ProgressNote | None:
    """This worker's progress note, when its agent asked for notes (and the directory takes one)."""
    env = environ
    directory, local_rank = env.get(NOTES_ENV), env.get("LOCAL_RANK", "")
    if not directory or not local_rank.isdigit():
        return None
    try:
        return ProgressNote(directory, int(local_rank))
    except OSError:
        return None


def _read(path: Path) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, MAX_NOTE + 1)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_progress(directory: str | os.PathLike[str], local_rank: int) -> int | None:
    """The last step worker `local_rank` noted as completed; None when it noted none (or not a valid one)."""
    data = _read(progress_path(directory, local_rank))
    if data is None or len(data) != _PROGRESS.size:
        return None
    magic, _, step = _PROGRESS.unpack(data)
    return step if magic == MAGIC and step >= 0 else None


def write_json(path: Path, value: dict[str, Any]) -> bool:
    """Replace the note at `path` with `value` (at most `MAX_NOTE` bytes of JSON); False when it cannot."""
    data = json.dumps(value, separators=(",", ":")).encode()
    if len(data) > MAX_NOTE:
        return False
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        with open(temporary, "wb") as out:
            out.write(data)
        os.replace(temporary, path)
    except OSError:
        return False
    return True


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object noted at `path`, or None (absent, too long, not a JSON object)."""
    data = _read(path)
    if data is None or len(data) > MAX_NOTE:
        return None
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def note_events_path(directory: str | os.PathLike[str], events: str | os.PathLike[str]) -> None:
    write_json(events_path_note(directory), {"path": os.path.abspath(events)})


def read_events_path(directory: str | os.PathLike[str]) -> str | None:
    value = read_json(events_path_note(directory))
    path = value.get("path") if value else None
    if not isinstance(path, str) or not path.startswith("/") or len(path) > 4096 or not path.isprintable():
        return None
    return path


INCIDENTS = ("job_failures", "job_hangs_named", "nodes_set_aside")


def incidents_path(directory: str | os.PathLike[str]) -> Path:
    return Path(directory) / "incidents"


def note_incidents(directory: str | os.PathLike[str], counts: dict[str, int]) -> None:
    write_json(incidents_path(directory), {name: int(counts.get(name, 0)) for name in INCIDENTS})


def read_incidents(directory: str | os.PathLike[str]) -> dict[str, int]:
    """The agent's counts (each a whole number from 0 to 2**31; any other value reads as 0)."""
    value = read_json(incidents_path(directory)) or {}
    return {name: count if type(count := value.get(name)) is int and 0 <= count < 1 << 31 else 0 for name in INCIDENTS}
