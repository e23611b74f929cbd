"""A restore's snapshot parts as one rank reads them: through maps here, by range requests elsewhere.

`memory.MemorySnapshots.gather_files` lays out, for one rank, the part of every
old rank: a symlink when this node holds it, the keepers to ask when only
another node does. `PartFiles` is then the `chunks.ChunkSource` the reader
takes the bytes from.

Invariants:
- Nothing fetched is trusted: every range comes back only with the keeper's tag
  verified (keeper_client.py), and the reader checks every block's crc32c, as for a file.
- This node's parts are read through the links the restore laid out (followed: they
  are this rank's own), only as regular files and never past their size.
- Only the spans this rank's plan reads are fetched (nearby spans joined,
  `READ_GAP`), one request at a time, each at most `READ_MAX` bytes: few round
  trips, bounded memory; the requests to one keeper share a kept connection.
- A keeper that fails is asked again only after the others holding the part;
  when all fail, or the deadline has passed, `PartFetchError` (an `OSError`):
  every rank then falls back to disk alike.
- Every request has an overall deadline (keeper_client.py), not only one per
  read: at most `FETCH_TIMEOUT`, and at most an equal share of the time left
  among the keepers still to ask, so a slow or stalled keeper leaves time for
  the next one, and the last one's failure for the disk.
"""

from __future__ import annotations

import http.client
import time
from pathlib import Path
from urllib.parse import urlsplit

from elastic._shared.storage import validate
from elastic._shared.storage.chunks import MappedFiles
from elastic._shared.storage.peer_auth import PeerKey
from elastic._worker.checkpoint.keeper_client import KeeperConnections
from elastic._worker.timings import FETCH_TIMEOUT


READ_GAP = 2**20
READ_MAX = 2**26
"""Spans of a remote part at most READ_GAP apart are fetched in one request of up to READ_MAX
bytes (a larger chunk in one of its own): few round trips, bounded memory."""


class PartFetchError(OSError):
    """No keeper sent a part's bytes (in time): the restore falls back to disk."""


class PartFiles:
    """A restore's parts as one rank reads them (a `chunks.ChunkSource`): this node's through
    maps, another node's by HTTP range requests to the keepers holding them, for the spans the
    rank's plan reads only (nearby spans joined, see `READ_GAP`), one request at a time.

    Nothing fetched is trusted: the reader checks every block's crc32c as for a file. A keeper
    that fails is asked again only after the others holding the part; when all fail, or
    `deadline` (time.monotonic) has passed, a `PartFetchError`."""

    def __init__(
        self, directory: Path, remote: dict[str, list[str]], *, key: PeerKey | None, deadline: float | None = None
    ) -> None:
        self.directory = directory
        self._key = key
        """The job's secret: signs the range requests (None: only this node's parts can be read)."""
        self.remote = remote
        """file name -> URLs of the keepers that hold it, in the order to try them."""
        self.deadline = deadline
        self._failed: set[str] = set()
        # Maps only in memory: on a disk (TORCHREVIVE_SNAPSHOT_BASE may name one) a read
        # error through a map would be a SIGBUS, not an OSError.
        self._maps = MappedFiles(directory, follow_links=True) if in_memory(directory) else None
        self._requests: dict[str, list[tuple[int, int]]] = {}
        self._held: tuple[str, int, int, bytearray] | None = None
        self.connections = KeeperConnections()
        """Kept open between requests: about one per keeper for the whole restore."""
        self.bytes_fetched = 0

    def expect(self, spans: list[tuple[str, int, int]]) -> None:
        self._requests = {}
        for file, start, stop in sorted(s for s in spans if s[0] in self.remote):
            joined = self._requests.setdefault(file, [])
            if joined and start - joined[-1][1] <= READ_GAP and stop - joined[-1][0] <= READ_MAX:
                joined[-1] = (joined[-1][0], max(joined[-1][1], stop))
            else:
                joined.append((start, stop))

    def view(self, file: str, start: int, stop: int) -> memoryview | bytearray | None:
        if file not in self.remote:
            return self._maps.view(file, start, stop) if self._maps is not None else _read_span(self.directory / file, start, stop)
        held = self._held
        if held is None or held[0] != file or not held[1] <= start <= stop <= held[2]:
            lo, hi = next(((a, b) for a, b in self._requests.get(file, []) if a <= start and stop <= b), (start, stop))
            data = self._fetch(file, lo, hi)
            if len(data) < hi - lo:  # the part is shorter than its header says
                return None
            held = self._held = (file, lo, hi, data)
        return memoryview(held[3])[start - held[1] : stop - held[1]]

    def _fetch(self, file: str, start: int, stop: int) -> bytearray:
        errors = []
        urls = sorted(self.remote[file], key=lambda u: u in self._failed)  # stable: failed ones last
        for tried, url in enumerate(urls):
            timeout = FETCH_TIMEOUT
            if self.deadline is not None:
                # An equal share of what is left: a stalled keeper leaves time for the next.
                timeout = min(timeout, (self.deadline - time.monotonic()) / (len(urls) - tried))
                if timeout <= 0:
                    errors.append("the restore's time for fetching parts is spent")
                    break
            if self._key is None:
                errors.append("no snapshot secret to sign requests with")
                break
            try:
                data = self.connections.get_range(url, self._key, start, stop, timeout)
                self.bytes_fetched += len(data)
                return data
            except (OSError, ValueError, http.client.HTTPException) as exc:
                self._failed.add(url)
                errors.append(f"{urlsplit(url).netloc}: {exc}")
        raise PartFetchError(f"no keeper could send {file} ({'; '.join(errors)})")

    def close(self) -> None:
        self._held = None
        self.connections.close()
        if self._maps is not None:
            self._maps.close()


def in_memory(path: Path) -> bool:
    """Whether `path` lies on a tmpfs (the longest mount point above it, from /proc/self/mounts)."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return False
    resolved, best, kind = str(path.resolve()), "", ""
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (resolved == point or resolved.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, kind = point, fields[2]
    return kind == "tmpfs"


def _read_span(path: Path, start: int, stop: int) -> bytearray | None:
    """Bytes [start, stop) of this node's part at `path` (a link the restore laid out), or None
    if it is shorter. Read only as a regular file (`CorruptCheckpoint` otherwise, never a wait
    on a FIFO or an endless device) and never past its size: no allocation larger than the file."""
    with validate.open_regular(path, path.name, follow_link=True) as f:
        if start < 0 or stop < start or validate.file_size(f) < stop:
            return None
        buffer = bytearray(stop - start)
        f.seek(start)
        got = f.readinto(buffer)
    return buffer if got == stop - start else None
