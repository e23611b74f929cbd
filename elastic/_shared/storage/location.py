"""What `--ckpt-dir` names: a local directory, or a prefix in an S3 bucket (`s3://BUCKET/PREFIX`).

Invariants:
- Text with a URL scheme (`NAME://...`) is never taken for a path: `s3://` is a
  bucket, any other scheme is refused in one line (`UsageError`) naming the
  supported ones. Before this check `s3://bucket/run` became a local folder
  named `s3:`, whose checkpoints died with the node.
- A bucket name follows S3's rules (3 to 63 lowercase letters, digits, dots
  and hyphens, starting and ending with a letter or digit); a prefix is a
  relative key path without empty, `.` or `..` segments, at most 512 bytes,
  so every key built under it stays within S3's 1024-byte limit.
- Importing this module imports nothing heavy (config.py checks the flag with it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from elastic._shared.common.errors import UsageError

SCHEMES = ("s3",)
"""The object stores `--ckpt-dir` takes; anything else with `://` is refused."""
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_SEGMENT = re.compile(r"^[A-Za-z0-9!_.*'()=+,;@-]{1,255}$")
MAX_PREFIX = 512


@dataclass(frozen=True)
class BucketLocation:
    """A prefix in a bucket: where a run's checkpoints live (`s3://bucket/prefix`)."""

    scheme: str
    bucket: str
    prefix: str
    """Without a leading or trailing slash; "" is the bucket's top."""

    def key(self, *names: str) -> str:
        """The object key of `names` under the prefix."""
        return "/".join(p for p in (self.prefix, *names) if p)

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}".rstrip("/")

    def __truediv__(self, name: str) -> str:
        """The URL of `name` under the prefix (for messages and events, as a directory's `root / name`)."""
        return f"{self}/{name}"

    def resolve(self) -> BucketLocation:
        """Already absolute (a directory's `root.resolve()` names the same place on every node)."""
        return self


def is_url(text: str) -> bool:
    """Whether `text` has a URL scheme (`NAME://`): never a local path."""
    return _SCHEME.match(text) is not None


def parse_bucket(text: str) -> BucketLocation:
    """The bucket location `text` names; `UsageError` (one line) for an unsupported scheme or a bad name."""
    match = _SCHEME.match(text)
    if match is None:
        raise UsageError(f"{text!r} is not a URL (s3://BUCKET/PREFIX)")
    scheme = match.group(1).lower()
    if scheme not in SCHEMES:
        raise UsageError(
            f"--ckpt-dir {text!r}: the scheme {scheme}:// is not supported; use a directory or "
            + " or ".join(f"{s}://BUCKET/PREFIX" for s in SCHEMES)
        )
    rest = text[match.end():]
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise UsageError(f"--ckpt-dir {text!r}: {bucket!r} is not a bucket name (3 to 63 of a-z, 0-9, '.', '-')")
    prefix = prefix.strip("/")
    if len(prefix.encode()) > MAX_PREFIX:
        raise UsageError(f"--ckpt-dir {text!r}: the prefix is longer than {MAX_PREFIX} bytes")
    for segment in prefix.split("/") if prefix else []:
        if segment in (".", "..") or not _SEGMENT.match(segment):
            raise UsageError(f"--ckpt-dir {text!r}: {segment!r} is not a plain key segment (letters, digits, -_.)")
    return BucketLocation(scheme, bucket, prefix)


def check(text: str) -> None:
    """`UsageError` (one line) unless `text` is a path or a supported bucket URL."""
    if is_url(text):
        parse_bucket(text)
