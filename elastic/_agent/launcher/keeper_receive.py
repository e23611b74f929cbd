"""A peer's snapshot part received into a keeper's replica directory: each slot's file reused, its header last.

A peer node's worker PUTs each of its parts here (keeper_endpoint.py): the JSON header, the
data, then the tag over both. A writer's parts come in two slots written in turn (parts.py),
so the same replica file is written again every other snapshot, at every step by default:
it is rewritten in place, through buffers kept from one upload to the next, instead of into a
new file and a new buffer per block, which cost this node 2.5 times the CPU per part
(tmpfs pages allocated, zeroed and freed, measured at 4.2 ms against 1.6 ms per 5 MB).

Invariants:
- The header is checked whole before any byte of the data is read (its name, its length,
  its run, generation and world size: `job.json`, written by this node's workers at each
  restore), and a part of anything else is refused (`Conflict`, 409).
- The slot's old header is removed before its data file is touched: from then until the new
  header is published nothing trusts that data, while the writer's other slot stays whole.
- The new header is published (temporary file, rename) only once the body's tag verified: a
  body cut short, tampered with or refused leaves the slot without a header, never a header
  over other data; a new file that did not verify is removed.
- A file is rewritten in place only at its own size; a part of another size (the writer's
  share changed) goes into a new file, renamed over the old one. One upload per slot at a
  time (a second is a `Conflict`): only a part's own writer uploads to its slot, one at a time,
  and a restore reads parts once every writer of their generation has stopped
  (storage.chunks.MappedFiles relies on it).
- Room: only a file's growth is reserved (keeper_space.UploadSpace); a rewrite needs none.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import uuid
from pathlib import Path
from typing import Any, BinaryIO

from elastic._agent.launcher.keeper_endpoint import Conflict
from elastic._agent.launcher.keeper_space import UploadSpace
from elastic._shared.common.errors import CorruptCheckpoint
from elastic._shared.storage import parts, peer_auth
from elastic._shared.storage.keeper_address import JOB_FILE
from elastic._shared.storage.parts import PartHeader
from elastic._shared.storage.validate import read_bounded

BLOCK = 2**20
"""Bytes read from the body at a time (one kept buffer per upload in flight)."""
MAX_JOB_BYTES = 4096
"""The most of `job.json` read (it holds a run id, a generation and a world size): read as a
small regular file only, so a FIFO or device put in its place is refused, never waited on."""


class ReplicaReceiver:
    """Takes the replicas of one keeper (see the module docstring). Thread-safe."""

    def __init__(self, root: Path, directory: Path, run_id: str, space: UploadSpace) -> None:
        """`root`: the keeper's directory (its `job.json`); `directory`: where replicas go."""
        self._root = root
        self._directory = directory
        self._run_id = run_id
        self.space = space
        """Room for the uploads in flight (keeper_space.py)."""
        self._buffers: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        self._in_flight: set[str] = set()  # the slots being written now
        self._lock = threading.Lock()
        self.files_made = 0
        """Data files created so far: one per slot of each peer writer, then none while its share keeps its size."""

    def receive(self, stem: str, head: bytes, body: BinaryIO, length: int, tag: Any) -> None:
        """Store a peer's part (keeper_endpoint.PartHolder.receive)."""
        header = PartHeader.from_json(head)
        if header.stem != stem or header.data_bytes != length:
            raise ValueError("the part's header does not match its name or length")
        self._check_job(header)
        with self._lock:
            if stem in self._in_flight:  # its writer has one upload in flight at most: this is a stale one's twin
                raise Conflict(f"an upload of {stem} is in flight")
            self._in_flight.add(stem)
        try:
            self._store(stem, header, body, length, tag)
        finally:
            with self._lock:
                self._in_flight.discard(stem)

    def _store(self, stem: str, header: PartHeader, body: BinaryIO, length: int, tag: Any) -> None:
        (self._directory / (stem + parts.HEADER_SUFFIX)).unlink(missing_ok=True)  # its data is not trusted from here
        data = self._directory / (stem + parts.DATA_SUFFIX)
        try:
            in_place = data.stat().st_size == length
        except FileNotFoundError:
            in_place = False
        target = data if in_place else self._directory / f".{stem}.{uuid.uuid4().hex[:6]}"
        try:
            self._write(target, body, length, tag, grow=0 if in_place else length)
            if not in_place:
                os.replace(target, data)
                self.files_made += 1
        finally:
            if not in_place:
                target.unlink(missing_ok=True)
        parts.write_header(self._directory, header)

    def _write(self, target: Path, body: BinaryIO, length: int, tag: Any, *, grow: int) -> None:
        """The body's `length` bytes into `target` through a kept buffer, then its tag checked
        (`ValueError` if the body ends early or the tag does not verify)."""
        with self.space.reserve(grow) as reservation:
            fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o600)
            buffer = self._take_buffer()
            try:
                view, at = memoryview(buffer), 0
                while at < length:
                    got = body.readinto(view[: min(BLOCK, length - at)])
                    if not got:
                        raise ValueError("the part ended early")
                    tag.update(view[:got])
                    os.pwrite(fd, view[:got], at)  # a full file system is an OSError here (not a map: no SIGBUS)
                    reservation.wrote(got)  # a no-op for a rewrite, which reserved nothing
                    at += got
            finally:
                self._buffers.put(buffer)
                os.close(fd)
        if not peer_auth.check_tag(tag, body.read(peer_auth.TAG_BYTES)):
            raise ValueError("the part's tag does not verify")

    def _take_buffer(self) -> bytearray:
        try:
            return self._buffers.get_nowait()
        except queue.Empty:
            return bytearray(BLOCK)  # bounded by the uploads in flight at once (the endpoint's slots)

    def _check_job(self, header: PartHeader) -> None:
        """`Conflict` unless `header` is of this run, and of the generation and world size this node's
        workers run (job.json, written at each restore): a part of an old timeline, or of another
        job sharing the secret, is never kept."""
        if header.run_id != self._run_id:
            raise Conflict(f"a part of run {header.run_id[:64]!r}; this keeper serves run {self._run_id!r}")
        try:
            job = json.loads(read_bounded(self._root / JOB_FILE, JOB_FILE, MAX_JOB_BYTES))
        except (OSError, ValueError, CorruptCheckpoint):
            raise Conflict("this node's workers have not started a generation yet") from None
        generation = str(header.extra.get("generation", ""))
        if not isinstance(job, dict) or (job.get("generation"), job.get("world_size")) != (generation, header.world_size):
            raise Conflict("a part of another generation or world size than this node's workers run")
