"""Moving a checkpoint's bytes to and from a bucket: in parallel ranges, never whole parts in memory.

- `PartUpload`: a write-only file object a rank's shard is written into; its
  bytes leave in `PIECE`-sized parts of a multipart upload, several at once;
- `BucketChunks`: the `chunks.ChunkSource` a restore reads a checkpoint's
  tensor chunks through: the spans the rank's plan needs, fetched ahead in
  ranges of at most `PIECE` bytes, several at once.

Invariants:
- Memory is bounded: an upload holds at most `IN_FLIGHT` pieces (one being
  filled, the rest on their way); a download at most `AHEAD_BYTES` fetched
  ahead of the reader, plus the span being read.
- An upload is invisible until `close` completes it (S3 makes a multipart
  object appear whole or not at all); completing is create-only, so no
  upload ever replaces an object, and a failed or abandoned one is aborted
  (`abort`), its parts dropped. A process killed mid-upload leaves an
  incomplete upload the store never shows (docs/object-storage.md: the
  bucket's lifecycle rule removes those).
- Nothing downloaded is trusted here: the reader checks every block's crc32c
  (chunks.read_rows). A missing object is a `FileNotFoundError`, one shorter
  than a span reads as None (a truncated file).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from elastic._shared.storage.object_store.objects import Objects

PIECE = 16 * 2**20
"""Bytes per uploaded part and per ranged request (S3's parts are at least 5 MiB but the last)."""
IN_FLIGHT = 6
"""Pieces of one upload in memory at once: one being filled, the others being sent."""
AHEAD_BYTES = 8 * PIECE
"""Bytes a download fetches ahead of its reader."""
THREADS = 8
"""Requests of one process at once (uploads and downloads share them)."""
JOIN_GAP = 2**20
JOIN_MAX = 4 * PIECE
"""Spans of one file at most JOIN_GAP apart are read as one range of up to JOIN_MAX bytes: few
requests for many small chunks (a range is still fetched as `PIECE`-sized requests at once)."""

_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def transfer_pool() -> ThreadPoolExecutor:
    """This process's transfer threads (one pool per process: a forked child's copy has no threads)."""
    with _pools_lock:
        pool = _pools.get(os.getpid())
        if pool is None:
            _pools.clear()
            pool = _pools[os.getpid()] = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="object-transfer")
        return pool


class PartUpload:
    """One object written as a stream (see the module docstring). `close` makes it appear;
    `abort` drops it. `bytes` counts what was written."""

    def __init__(self, objects: Objects, key: str, *, piece: int = PIECE) -> None:
        self._objects = objects
        self.key = key
        self._piece = piece
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._sent: list[Future[str]] = []
        self._slots = threading.BoundedSemaphore(IN_FLIGHT - 1)
        self.bytes = 0
        self._closed = False

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        taken = 0
        while taken < len(view):
            room = self._piece - len(self._buffer)
            self._buffer += view[taken : taken + room]
            taken += min(room, len(view) - taken)
            if len(self._buffer) >= self._piece:
                self._send(bytes(self._buffer))
                self._buffer = bytearray()
        self.bytes += len(view)
        return len(view)

    def _send(self, piece: bytes) -> None:
        if self._upload_id is None:
            self._upload_id = self._objects.start_upload(self.key)
        number = len(self._sent) + 1
        self._slots.acquire()  # at most IN_FLIGHT pieces in memory: the writer waits for the store
        upload_id = self._upload_id

        def send() -> str:
            try:
                return self._objects.upload_part(self.key, upload_id, number, piece)
            finally:
                self._slots.release()

        try:
            self._sent.append(transfer_pool().submit(send))
        except BaseException:
            self._slots.release()
            raise
        # A part that already failed stops the stream now, not at `close`.
        for future in self._sent:
            if future.done() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]

    def close(self) -> None:
        """Send what is left and make the object appear (create-only); raises the first failure,
        after dropping the upload."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._upload_id is None:
                self._objects.put(self.key, bytes(self._buffer), create_only=True)
                return
            if self._buffer:
                self._send(bytes(self._buffer))
            etags = [future.result() for future in self._sent]
            self._objects.complete_upload(self.key, self._upload_id, etags)
        except BaseException:
            self.abort()
            raise
        finally:
            self._buffer = bytearray()

    def abort(self) -> None:
        """Drop the upload (its parts are discarded by the store); no error if it is gone."""
        self._closed = True
        for future in self._sent:
            future.cancel()
        for future in self._sent:
            if not future.cancelled():
                try:
                    future.result()
                except Exception:  # noqa: BLE001 - the upload is being dropped: its failures no longer matter
                    pass
        if self._upload_id is not None:
            try:
                self._objects.abort_upload(self.key, self._upload_id)
            except OSError:
                pass  # the store drops it by its lifecycle rule (docs/object-storage.md)
        self._buffer = bytearray()

    def __enter__(self) -> PartUpload:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


class BucketChunks:
    """A checkpoint's files read from a bucket (a `chunks.ChunkSource`): `key_of(file)` is the
    object of a file. The spans a reader expects are joined into ranges (spans of one file at
    most `JOIN_GAP` apart, up to `JOIN_MAX` bytes), each fetched as `piece`-sized requests at
    once, ranges ahead of the reader up to `AHEAD_BYTES`; see the module docstring."""

    def __init__(self, objects: Objects, key_of: Callable[[str], str], *, piece: int = PIECE) -> None:
        self._objects = objects
        self._key_of = key_of
        self._piece = piece
        self._ranges: list[tuple[str, int, int]] = []
        self._fetched: dict[int, Future[bytearray | None]] = {}
        self._next = 0  # the first range not yet fetched
        self._current = 0  # the range the reader is in
        self.bytes_fetched = 0

    def expect(self, spans: list[tuple[str, int, int]]) -> None:
        self.close()
        for file, start, stop in spans:
            last = self._ranges[-1] if self._ranges else None
            if last and last[0] == file and 0 <= start - last[2] <= JOIN_GAP and stop - last[1] <= JOIN_MAX:
                self._ranges[-1] = (file, last[1], max(last[2], stop))
            else:
                self._ranges.append((file, start, stop))
        self._next = self._current = 0
        self._fill()

    def _fill(self) -> None:
        ahead = sum(hi - lo for i, (_, lo, hi) in enumerate(self._ranges) if self._current <= i < self._next)
        while self._next < len(self._ranges) and (ahead < AHEAD_BYTES or self._next <= self._current):
            file, start, stop = self._ranges[self._next]
            self._fetched[self._next] = self._fetch(file, start, stop)
            ahead += stop - start
            self._next += 1

    def _fetch(self, file: str, start: int, stop: int) -> Future[bytearray | None]:
        """One range, in requests of at most `piece` bytes sent at once into one buffer."""
        key = self._key_of(file)
        buffer = bytearray(stop - start)
        pool = transfer_pool()
        pieces = [(lo, min(lo + self._piece, stop)) for lo in range(start, stop, self._piece)]

        def one(lo: int, hi: int) -> bool:
            data = self._objects.get_range(key, lo, hi)
            buffer[lo - start : lo - start + len(data)] = data
            return len(data) == hi - lo

        parts = [pool.submit(one, lo, hi) for lo, hi in pieces]
        done: Future[bytearray | None] = Future()

        def gather(_: object = None) -> None:
            if not all(p.done() for p in parts) or done.done():
                return
            try:
                whole = all(p.result() for p in parts)
            except BaseException as exc:  # noqa: BLE001 - handed to the reader, in its thread
                _settle(done, error=exc)
                return
            _settle(done, value=buffer if whole else None)

        for part in parts:
            part.add_done_callback(gather)
        if not parts:
            _settle(done, value=buffer)
        return done

    def view(self, file: str, start: int, stop: int) -> memoryview | bytearray | None:
        for index in range(self._current, len(self._ranges)):
            name, lo, hi = self._ranges[index]
            if name == file and lo <= start and stop <= hi:
                for passed in range(self._current, index):  # the reader has left them: their memory goes
                    self._fetched.pop(passed, None)
                self._current = index
                self._fill()
                data = self._fetched[index].result()
                if data is None:  # the object is shorter than the range: is it shorter than this span?
                    data = self._fetch(file, start, stop).result()
                    return data
                self.bytes_fetched += stop - start
                return memoryview(data)[start - lo : stop - lo]
        data = self._fetch(file, start, stop).result()  # not a span it was told of: fetched on its own
        if data is not None:
            self.bytes_fetched += len(data)
        return data

    def close(self) -> None:
        for future in self._fetched.values():
            future.cancel()
        self._fetched.clear()
        self._ranges = []


def _settle(future: Future[bytearray | None], *, value: bytearray | None = None, error: BaseException | None = None) -> None:
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    except Exception:  # noqa: BLE001 - settled already by another piece's callback
        pass
