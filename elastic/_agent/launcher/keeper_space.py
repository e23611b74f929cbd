"""Room in node memory for the replicas a keeper is receiving: each upload reserves its declared length first.

Invariants (`UploadSpace`):
- An upload is accepted only if the file system's free space, less what the
  uploads in flight have reserved and not yet written, leaves `reserve_fraction`
  of it free after this one: concurrent uploads cannot each pass the check and
  fill it together (the check and the reservation are one step under a lock).
- A reservation shrinks as its bytes are written (they show in the free space
  from then on) and whatever is left of it is released when the upload ends,
  stored or failed.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class Reservation:
    """The bytes one upload still has to write (see `UploadSpace.reserve`)."""

    def __init__(self, space: UploadSpace, length: int) -> None:
        self._space = space
        self.left = length

    def wrote(self, n: int) -> None:
        """`n` more bytes are in the file system now."""
        self._space._shrink(self, min(n, self.left))


class UploadSpace:
    """The uploads in flight to `directory`'s file system (thread-safe)."""

    def __init__(self, directory: Path, reserve_fraction: float, usage: Callable[[Path], Any] | None = None) -> None:
        """`usage`: the file system's (total, used, free) for `directory` (default: `shutil.disk_usage`)."""
        self._directory = directory
        self._fraction = reserve_fraction
        self._usage = usage
        self._reserved = 0
        self._lock = threading.Lock()

    @property
    def reserved(self) -> int:
        """Bytes promised to uploads in flight and not yet written."""
        return self._reserved

    @contextmanager
    def reserve(self, length: int) -> Iterator[Reservation]:
        """Hold `length` bytes for one upload while the block runs; `OSError` (the keeper's 507) when
        they would leave too little room."""
        with self._lock:
            usage = (self._usage or shutil.disk_usage)(self._directory)
            if usage.free - self._reserved - length < self._fraction * usage.total:
                raise OSError(f"storing {length} bytes would leave too little room in {self._directory}"
                              f" ({self._reserved} bytes are promised to uploads in flight)")
            self._reserved += length
        reservation = Reservation(self, length)
        try:
            yield reservation
        finally:
            self._shrink(reservation, reservation.left)

    def _shrink(self, reservation: Reservation, n: int) -> None:
        with self._lock:
            reservation.left -= n
            self._reserved -= n
