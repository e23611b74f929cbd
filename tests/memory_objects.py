"""An object store in this process's memory, for unit tests of the bucket checkpoint store.

It keeps the promises the code relies on as S3 does: `create_only` puts and
`if_match` puts are refused (`ConditionFailed`) unless their condition holds,
a multipart upload is invisible until completed, listings are in key order.
`fail` makes chosen requests fail (`StoreUnavailable`), `before` runs a hook
before a request (a kill, another writer racing), so faults land exactly where
a test says.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable

from elastic._shared.storage.object_store.objects import (
    ConditionFailed,
    ObjectInfo,
    ObjectMissing,
    ObjectTooLarge,
    StoreUnavailable,
)


class MemoryObjects:
    def __init__(self, name: str = "s3://memory") -> None:
        self.name = name
        self.objects: dict[str, tuple[bytes, str, float]] = {}
        self.uploads: dict[str, tuple[str, dict[int, bytes]]] = {}
        self.requests: list[tuple[str, str]] = []
        self.fail: Callable[[str, str], bool] = lambda op, key: False
        self.before: Callable[[str, str], None] = lambda op, key: None
        self._lock = threading.Lock()

    def _enter(self, op: str, key: str) -> None:
        self.before(op, key)
        with self._lock:
            self.requests.append((op, key))
        if self.fail(op, key):
            raise StoreUnavailable(f"{op} {key}: InternalError (HTTP 500)")

    def put(self, key: str, data: bytes, *, create_only: bool = False, if_match: str | None = None) -> str:
        self._enter("put", key)
        with self._lock:
            there = self.objects.get(key)
            if create_only and there is not None:
                raise ConditionFailed(f"writing {key}: PreconditionFailed (HTTP 412)")
            if if_match is not None and (there is None or there[1] != if_match):
                raise ConditionFailed(f"writing {key}: PreconditionFailed (HTTP 412)")
            etag = '"' + hashlib.md5(bytes(data) + str(time.monotonic_ns()).encode()).hexdigest() + '"'
            self.objects[key] = (bytes(data), etag, time.time())
            return etag

    def get(self, key: str, *, limit: int) -> tuple[bytes, str]:
        self._enter("get", key)
        with self._lock:
            if key not in self.objects:
                raise ObjectMissing(f"reading {key}: NoSuchKey (HTTP 404)")
            data, etag, _ = self.objects[key]
        if len(data) > limit:
            raise ObjectTooLarge(f"reading {key}: {len(data)} bytes, more than the {limit} read", etag)
        return data, etag

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        self._enter("get_range", key)
        with self._lock:
            if key not in self.objects:
                raise ObjectMissing(f"reading {key}: NoSuchKey (HTTP 404)")
            return self.objects[key][0][start:stop]

    def head(self, key: str) -> int:
        self._enter("head", key)
        with self._lock:
            if key not in self.objects:
                raise ObjectMissing(f"looking up {key}: 404 (HTTP 404)")
            return len(self.objects[key][0])

    def list(self, prefix: str) -> list[ObjectInfo]:
        self._enter("list", prefix)
        with self._lock:
            return [ObjectInfo(k, len(v[0]), v[2]) for k, v in sorted(self.objects.items()) if k.startswith(prefix)]

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            self._enter("delete", key)
            with self._lock:
                self.objects.pop(key, None)

    def start_upload(self, key: str) -> str:
        self._enter("start_upload", key)
        upload_id = hashlib.md5(f"{key}{time.monotonic_ns()}".encode()).hexdigest()
        with self._lock:
            self.uploads[upload_id] = (key, {})
        return upload_id

    def upload_part(self, key: str, upload_id: str, number: int, data: bytes | memoryview) -> str:
        self._enter("upload_part", key)
        with self._lock:
            if upload_id not in self.uploads:
                raise ObjectMissing(f"uploading {key}: NoSuchUpload (HTTP 404)")
            self.uploads[upload_id][1][number] = bytes(data)
        return f'"{number}"'

    def complete_upload(self, key: str, upload_id: str, etags: list[str]) -> None:
        self._enter("complete_upload", key)
        with self._lock:
            _, parts = self.uploads.pop(upload_id)
            if key in self.objects:  # create-only, as the uploads of a save are
                raise ConditionFailed(f"completing {key}: PreconditionFailed (HTTP 412)")
            data = b"".join(parts[i + 1] for i in range(len(etags)))
            self.objects[key] = (data, f'"{hashlib.md5(data).hexdigest()}-{len(etags)}"', time.time())

    def abort_upload(self, key: str, upload_id: str) -> None:
        self._enter("abort_upload", key)
        with self._lock:
            self.uploads.pop(upload_id, None)

    def check_access(self) -> None:
        self._enter("check_access", "")
