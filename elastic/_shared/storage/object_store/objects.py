"""What the checkpoint code needs of an object store, and how its failures look.

Invariants:
- Every failure is an `OSError`, so the code written for a directory handles a
  bucket's failures the same way (a failed save, a storage stop, a fallback):
  `ObjectMissing` is a `FileNotFoundError`; `ConditionFailed` is a conditional
  write the store refused (the object exists, or changed since it was read);
  `StoreUnavailable` anything else (after the client's retries).
- A conditional create (`put(..., create_only=True)`) either creates the object
  or raises `ConditionFailed`; it never replaces one: the whole commit protocol
  rests on it (bucket.py). A store whose server ignores the condition must not
  be used: tests/integration/test_object_store.py proves the server the tests
  use enforces it.
- `get` reads at most `limit` bytes: a larger object is refused before its body
  is read, so a crafted object never becomes an allocation.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Protocol


class ObjectStoreError(OSError):
    """A request the object store did not carry out (its message is one line, never a secret)."""


class ObjectMissing(FileNotFoundError):
    """No object of that key (HTTP 404)."""


class ConditionFailed(ObjectStoreError):
    """A conditional write refused (HTTP 412 or 409): the object exists, or is not the one read."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EEXIST, message)


class StoreUnavailable(ObjectStoreError):
    """The store could not be reached or kept failing (after retries), or refused access."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)


class ObjectTooLarge(ObjectStoreError):
    """An object larger than the reader's limit: never read. `etag`: the object's, so a
    conditional write may still replace it."""

    def __init__(self, message: str, etag: str = "") -> None:
        super().__init__(errno.EFBIG, message)
        self.etag = etag


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object."""

    key: str
    size: int
    modified: float
    """Seconds since the epoch (the store's clock)."""


class Objects(Protocol):
    """One bucket, as the checkpoint code uses it (s3.S3Objects; tests' MemoryObjects)."""

    name: str
    """The bucket's URL, for messages."""

    def put(self, key: str, data: bytes, *, create_only: bool = False, if_match: str | None = None) -> str:
        """Store `data` at `key`; its ETag. `create_only`: only if no object is there (`If-None-Match: *`);
        `if_match`: only if the object there has this ETag. Refused: `ConditionFailed`."""

    def get(self, key: str, *, limit: int) -> tuple[bytes, str]:
        """The object's bytes and ETag (`ObjectMissing`; `ObjectTooLarge` past `limit` bytes, unread)."""

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of the object (fewer when it is shorter; `ObjectMissing`)."""

    def head(self, key: str) -> int:
        """The object's size (`ObjectMissing`)."""

    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with `prefix`, in key order."""

    def delete(self, keys: list[str]) -> None:
        """Remove these objects (a missing one is no error)."""

    def start_upload(self, key: str) -> str:
        """A multipart upload to `key`; its id."""

    def upload_part(self, key: str, upload_id: str, number: int, data: bytes | memoryview) -> str:
        """Part `number` (from 1) of the upload; its ETag."""

    def complete_upload(self, key: str, upload_id: str, etags: list[str]) -> None:
        """Make the parts (in order) the object at `key`, only if none is there (`ConditionFailed`)."""

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Drop an upload and its parts (no error if it is gone)."""

    def check_access(self) -> None:
        """`StoreUnavailable` naming why (bad credentials, no such bucket, no endpoint), at start."""
