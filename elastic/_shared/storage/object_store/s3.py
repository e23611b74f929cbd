"""`objects.Objects` on S3 and S3-compatible servers, through boto3.

Why boto3: the reference client of the S3 API, maintained by the store's
maker, with conditional writes (`IfNoneMatch`, `IfMatch` on PutObject and
CompleteMultipartUpload), retries with exponential backoff and jitter for 5xx
and throttling (its "standard" mode), connect and read timeouts on every
request, a thread-safe client (one connection pool for the parallel ranges),
and the standard credential chain (environment, ~/.aws files, instance and
container roles). Pure-Python wheels: nothing to build on a cluster's nodes.

Invariants:
- Credentials and the endpoint come only from the standard environment
  (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
  `AWS_ENDPOINT_URL`, `AWS_REGION` or `AWS_DEFAULT_REGION`) or boto3's own
  configuration files; never from a flag, and no message or log line of this
  module holds a key, a token or a signature: errors are rebuilt from the
  error code and HTTP status alone.
- Every request has a deadline: `CONNECT_TIMEOUT` to connect and
  `READ_TIMEOUT` per read, retried at most `MAX_ATTEMPTS` times in all, with
  backoff, for 5xx answers, throttling and dropped connections. An object's body
  is read within a deadline for the whole of it (`read_deadline`: a server that
  trickles a byte per read timeout never trips that timeout): it ends by then,
  give or take one read, with `StoreUnavailable`. A conditional
  write retried after its first try succeeded unseen finds its own object
  there: callers treat `ConditionFailed` by reading what is there (bucket.py).
- Every failure is one of objects.py's `OSError`s.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

from elastic._shared.storage.location import BucketLocation
from elastic._shared.storage.object_store.objects import (
    ConditionFailed,
    ObjectInfo,
    ObjectMissing,
    ObjectTooLarge,
    StoreUnavailable,
)
from elastic._shared.timings import CONNECT_TIMEOUT, READ_DEADLINE, READ_TIMEOUT

MAX_ATTEMPTS = 6
"""Tries per request (the first and five retries, backoff with jitter up to 20 s between them)."""
POOL = 32
"""Connections kept to the store: the parallel ranges of one process share them."""
MIN_READ_RATE = 1 << 20
"""A body of N bytes is read within READ_DEADLINE + N / MIN_READ_RATE seconds (1 MiB/s: far below any store's)."""
CHUNK = 1 << 20
_T = TypeVar("_T")
_MISSING = {"NoSuchKey", "NotFound", "404", "NoSuchUpload"}
_CONDITION = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}
_DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}


def _client(location: BucketLocation, attempts: int) -> Any:
    import boto3
    from botocore.config import Config

    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    config = Config(
        connect_timeout=CONNECT_TIMEOUT,
        read_timeout=READ_TIMEOUT,
        retries={"mode": "standard", "max_attempts": attempts},
        max_pool_connections=POOL,
        tcp_keepalive=True,
        # A server of its own (an endpoint URL) is addressed by path: its host name is no bucket's.
        s3={"addressing_style": "path" if endpoint else "auto"},
    )
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
    return boto3.session.Session().client("s3", region_name=region, endpoint_url=endpoint or None, config=config)


class S3Objects:
    """A bucket on S3 or an S3-compatible server (see the module docstring)."""

    def __init__(self, location: BucketLocation, *, attempts: int = MAX_ATTEMPTS) -> None:
        self.bucket = location.bucket
        self.name = f"{location.scheme}://{location.bucket}"
        try:
            self._s3 = _client(location, attempts)
        except Exception as exc:  # noqa: BLE001 - a malformed endpoint or region in the environment
            raise StoreUnavailable(f"cannot set up the S3 client for {self.name}: {_describe(exc)}") from None

    # -- one request, its failures as OSErrors ------------------------------------------

    def _call(self, what: str, request: Callable[[], _T]) -> _T:
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        try:
            return request()
        except ClientError as exc:
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            said = f"{what}: {code or 'error'} (HTTP {status})"
            if code in _CONDITION or status in (409, 412):
                raise ConditionFailed(said) from None
            if code == "NoSuchBucket":
                raise StoreUnavailable(f"{what}: the bucket {self.bucket} does not exist") from None
            if code in _MISSING or status == 404:
                raise ObjectMissing(said) from None
            if code in _DENIED or status == 403:
                raise StoreUnavailable(f"{what}: access denied ({code or status}): check the credentials "
                                       "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) and the bucket's policy") from None
            raise StoreUnavailable(said) from None
        except NoCredentialsError:
            raise StoreUnavailable(f"{what}: no credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                                   "or configure boto3)") from None
        except BotoCoreError as exc:
            raise StoreUnavailable(f"{what}: {_describe(exc)}") from None

    # -- objects.Objects ------------------------------------------------------------------

    def put(self, key: str, data: bytes, *, create_only: bool = False, if_match: str | None = None) -> str:
        extra: dict[str, str] = {}
        if create_only:
            extra["IfNoneMatch"] = "*"
        if if_match is not None:
            extra["IfMatch"] = if_match
        answer = self._call(f"writing {self.name}/{key}",
                            lambda: self._s3.put_object(Bucket=self.bucket, Key=key, Body=data, **extra))
        return str(answer.get("ETag", ""))

    def get(self, key: str, *, limit: int) -> tuple[bytes, str]:
        where = f"reading {self.name}/{key}"
        answer = self._call(where, lambda: self._s3.get_object(Bucket=self.bucket, Key=key))
        body = answer["Body"]
        try:
            size = int(answer.get("ContentLength", -1))
            if size > limit:
                raise ObjectTooLarge(f"{where}: {size} bytes, more than the {limit} read", str(answer.get("ETag", "")))
            data = self._call(where, lambda: read_within(body, limit + 1, where, declared=size))
        finally:
            body.close()
        if len(data) > limit:
            raise ObjectTooLarge(f"{where}: more than the {limit} bytes read", str(answer.get("ETag", "")))
        return data, str(answer.get("ETag", ""))

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        if stop <= start:
            return b""
        where = f"reading {self.name}/{key} bytes {start}..{stop}"
        try:
            answer = self._call(where, lambda: self._s3.get_object(Bucket=self.bucket, Key=key,
                                                                   Range=f"bytes={start}-{stop - 1}"))
        except StoreUnavailable as exc:
            if "InvalidRange" in str(exc):  # the object is shorter than `start`
                return b""
            raise
        body = answer["Body"]
        try:
            declared = int(answer.get("ContentLength", stop - start))
            return self._call(where, lambda: read_within(body, stop - start, where, declared=declared))
        finally:
            body.close()

    def head(self, key: str) -> int:
        answer = self._call(f"looking up {self.name}/{key}", lambda: self._s3.head_object(Bucket=self.bucket, Key=key))
        return int(answer["ContentLength"])

    def list(self, prefix: str) -> list[ObjectInfo]:
        found: list[ObjectInfo] = []
        pages = self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        iterator = iter(pages)
        while True:
            page = self._call(f"listing {self.name}/{prefix}", lambda: next(iterator, None))
            if page is None:
                return found
            for item in page.get("Contents", []):
                found.append(ObjectInfo(str(item["Key"]), int(item["Size"]), item["LastModified"].timestamp()))

    def delete(self, keys: list[str]) -> None:
        for at in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": k} for k in keys[at : at + 1000]]
            answer = self._call(f"deleting from {self.name}", lambda: self._s3.delete_objects(
                Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}))
            errors = [e for e in answer.get("Errors", []) if e.get("Code") not in _MISSING]
            if errors:
                raise StoreUnavailable(f"deleting from {self.name}: {len(errors)} objects not deleted "
                                       f"({errors[0].get('Code')})")

    def start_upload(self, key: str) -> str:
        answer = self._call(f"starting an upload to {self.name}/{key}",
                            lambda: self._s3.create_multipart_upload(Bucket=self.bucket, Key=key))
        return str(answer["UploadId"])

    def upload_part(self, key: str, upload_id: str, number: int, data: bytes | memoryview) -> str:
        answer = self._call(f"uploading part {number} of {self.name}/{key}", lambda: self._s3.upload_part(
            Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=bytes(data)))
        return str(answer["ETag"])

    def complete_upload(self, key: str, upload_id: str, etags: list[str]) -> None:
        # Create-only, as every upload of a save: a completed upload never replaces an object.
        parts = [{"PartNumber": i + 1, "ETag": etag} for i, etag in enumerate(etags)]
        self._call(f"completing the upload of {self.name}/{key}", lambda: self._s3.complete_multipart_upload(
            Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}, IfNoneMatch="*"))

    def abort_upload(self, key: str, upload_id: str) -> None:
        try:
            self._call(f"dropping the upload of {self.name}/{key}", lambda: self._s3.abort_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id))
        except ObjectMissing:
            pass

    def check_access(self) -> None:
        try:
            self._call(f"opening {self.name}", lambda: self._s3.head_bucket(Bucket=self.bucket))
        except ObjectMissing:  # HeadBucket has no body: a missing bucket is a bare 404
            raise StoreUnavailable(f"opening {self.name}: the bucket {self.bucket} does not exist") from None


def read_deadline(amount: int) -> float:
    """Seconds to read a body of `amount` bytes in (see the module docstring)."""
    return READ_DEADLINE + amount / MIN_READ_RATE


def read_within(body: Any, amount: int, where: str, *, declared: int = -1) -> bytes:
    """Up to `amount` bytes of `body` (botocore's StreamingBody), by its deadline; `StoreUnavailable`
    past it, or when the body ends before the `declared` length (its Content-Length; -1: unknown). Each
    read returns what one receive got (urllib3's `read1`), so the deadline is checked however slowly
    the bytes come; without `read1` (another HTTP client) each read is at most `CHUNK`."""
    deadline = time.monotonic() + read_deadline(amount)
    stream = getattr(body, "_raw_stream", None)
    read = stream.read1 if hasattr(stream, "read1") else body.read
    chunks: list[bytes] = []
    got = 0
    while got < amount:
        if time.monotonic() > deadline:
            raise StoreUnavailable(f"{where}: {got} of at most {amount} bytes came in {read_deadline(amount):.0f} s; "
                                   "the store is too slow (or trickling), the read is abandoned")
        chunk = read(min(CHUNK, amount - got))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    if 0 <= got < min(amount, declared):
        raise StoreUnavailable(f"{where}: the connection closed after {got} of {declared} bytes")
    return b"".join(chunks)


def _describe(exc: BaseException) -> str:
    """One line for a client-side failure (no endpoint, a timeout): botocore's own text names the
    endpoint and the cause, never a credential."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return f"{type(exc).__name__}: {text}"[:300]
