"""Which job writes a bucket prefix: `PREFIX/writer.json`, replaced only by conditional writes.

The claim is the directory's (storage/claim.py: `WriterIdentity`, who is alive,
who may take over, who may commit), stored as an object. What a bucket adds:

Invariants:
- The claim object is created with `If-None-Match: *` and replaced with
  `If-Match: <the ETag read>`: of two writers claiming at once, one wins and
  the other re-reads and is judged against the winner; nothing replaces a
  claim it did not read.
- A conditional write that fails because its own earlier try succeeded unseen
  (a retry after a lost answer) finds its own claim on re-reading: no failure.
- writer.json is untrusted: read at most `claim.MAX_CLAIM_BYTES`; a claim that
  does not parse counts as none, with one warning per prefix and reason.
"""

from __future__ import annotations

import logging
from dataclasses import asdict

from elastic._shared.common.errors import CheckpointStorageError
from elastic._shared.storage import claim as claims
from elastic._shared.storage.claim import WRITER, WriterIdentity
from elastic._shared.storage.durable import SaveFailed
from elastic._shared.storage.object_store.objects import ConditionFailed, ObjectMissing, Objects, ObjectTooLarge

logger = logging.getLogger(__name__)
_warned: set[tuple[str, str]] = set()


class BucketClaim:
    """The claim object of one prefix (`key`), `where` naming the prefix in messages."""

    def __init__(self, objects: Objects, key: str, where: str) -> None:
        self._objects = objects
        self.key = key
        self.where = where

    def current(self) -> tuple[WriterIdentity | None, str | None]:
        """Who claimed the prefix last (None: nobody, or an unreadable claim) and the ETag read (None: no object)."""
        try:
            raw, etag = self._objects.get(self.key, limit=claims.MAX_CLAIM_BYTES)
        except ObjectMissing:
            return None, None
        except ObjectTooLarge as exc:
            self._warn(str(exc))
            return None, exc.etag or None
        try:
            return WriterIdentity.from_json(raw.decode("utf-8")), etag
        except (ValueError, TypeError, RecursionError, UnicodeDecodeError) as exc:
            self._warn(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return None, etag

    def _warn(self, why: str) -> None:
        if (self.where, why) not in _warned:
            _warned.add((self.where, why))
            logger.warning("ignoring the claim %s/%s (%s): it counts as none", self.where, WRITER, why)

    def _write(self, identity: WriterIdentity, etag: str | None) -> None:
        data = identity.to_json().encode("utf-8")
        if etag is None:
            self._objects.put(self.key, data, create_only=True)
        else:
            self._objects.put(self.key, data, if_match=etag)

    def claim(self, identity: WriterIdentity) -> None:
        """Make `identity` the prefix's writer; `CheckpointStorageError` if another live job writes here."""
        for _ in range(3):
            holder, etag = self.current()
            claims.judge_takeover(holder, identity, self.where, f"{self.where}/{WRITER}")
            try:
                self._write(identity, etag)
                return
            except ConditionFailed:
                holder, _ = self.current()
                if holder is not None and holder.writer == identity.writer:
                    return  # our own write, answered late
                # Another writer claimed meanwhile: judge it on the next round.
        raise CheckpointStorageError(f"cannot claim {self.where}: its claim keeps changing under this writer")

    def refresh(self, identity: WriterIdentity) -> None:
        """A new heartbeat; `SaveFailed` if the claim is no longer `identity`'s."""
        holder, etag = self.current()
        claims.judge_commit(holder, self.where, identity.run_id, identity)
        try:
            self._write(identity.beat(), etag)
        except ConditionFailed:
            holder, _ = self.current()
            if holder is None or holder.writer != identity.writer:
                raise SaveFailed(f"{self.where} was claimed by another writer meanwhile; this one stops writing there") from None

    def check_may_commit(self, run_id: str, owner: WriterIdentity | None) -> None:
        """`SaveFailed` unless the prefix is still `owner`'s, or without one, its job's (`run_id`)."""
        holder, _ = self.current()
        claims.judge_commit(holder, self.where, run_id, owner)

    def release(self, identity: WriterIdentity) -> None:
        """The job ended: heartbeat 0, so the next job takes the prefix at once (nothing if another holds it)."""
        holder, etag = self.current()
        if holder is not None and holder.writer == identity.writer:
            ended = WriterIdentity(**{**asdict(identity), "heartbeat": 0.0})
            try:
                self._write(ended, etag)
            except ConditionFailed:
                pass  # another writer's claim by now: it stays
