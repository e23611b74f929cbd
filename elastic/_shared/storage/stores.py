"""The checkpoint store `--ckpt-dir` names: a directory's `CheckpointStore`, or a bucket's `BucketStore`.

Both implement `checkpoint_storage.CheckpointStorage` (claim, begin, write, finish, abort,
committed, read, verify, quarantine), so the workers, the keeper and the tools choose
here once and never look at the scheme again.

Invariants:
- A bucket is checked before anything else is done with it (`check=True`):
  credentials that are refused, a bucket that does not exist or an endpoint
  that does not answer are one `UsageError` line (exit status 2), at start.
- Any `SCHEME://` other than a supported one is a `UsageError`, never a path.
"""

from __future__ import annotations

from typing import Any

from elastic._shared.common.errors import UsageError
from elastic._shared.storage import location
from elastic._shared.storage.checkpoint_storage import CheckpointStorage
from elastic._shared.storage.directory import CheckpointStore
from elastic._shared.storage.object_store.bucket import BucketStore
from elastic._shared.storage.object_store.objects import StoreUnavailable

START_CHECK_ATTEMPTS = 2
"""Tries of the first request to a bucket: a wrong endpoint is said within seconds, not after every retry."""


def open_store(ckpt_dir: str, *, keep: int = 3, check: bool = True) -> CheckpointStorage[Any]:
    """The store of `ckpt_dir` (a directory, or `s3://BUCKET/PREFIX`); see the module docstring."""
    if not location.is_url(ckpt_dir):
        return CheckpointStore(ckpt_dir, keep=keep)
    where = location.parse_bucket(ckpt_dir)
    from elastic._shared.storage.object_store.s3 import S3Objects

    try:
        if check:
            S3Objects(where, attempts=START_CHECK_ATTEMPTS).check_access()
        objects = S3Objects(where)
    except StoreUnavailable as exc:
        raise UsageError(f"--ckpt-dir {where}: {exc.strerror or exc}") from None
    return BucketStore(where, objects, keep=keep)
