"""Rank 0's hold on the checkpoint directory: claimed once, kept fresh by a heartbeat.

Invariants:
- `prepare` runs once, on rank 0, at the first restore or save: it creates the
  directory, claims it (storage.claim: another live job's directory is one
  `CheckpointStorageError` line), puts back a copy a crash left replaced,
  removes saves that died before their commit and checks a write gets through.
  Any storage error on the way (writing the claim on a full disk, say) is one
  `CheckpointStorageError` line, which the restore raises on every rank.
- The heartbeat thread refreshes the claim between rare commits, so another
  host never takes this job for gone; it stops once the claim is lost (the
  next commit then says so), and is stopped and joined by `stop` or at exit: a
  daemon thread alive while the interpreter shuts down can abort the process
  ("terminate called without an active exception") instead of letting it exit 0.
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Any

from elastic._shared.common import threads
from elastic._shared.common.errors import CheckpointStorageError
from elastic._shared.storage.checkpoint_storage import CheckpointStorage
from elastic._shared.storage.claim import WriterIdentity
from elastic._shared.storage.durable import SaveFailed, describe_failure

logger = logging.getLogger(__name__)


class DirectoryClaim:
    """Rank 0's claim on `store` for run `run_id` (see the module docstring)."""

    def __init__(self, store: CheckpointStorage[Any], run_id: str) -> None:
        self.store = store
        self.identity = WriterIdentity.new(run_id)
        self._prepared = False
        self._closing = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def prepare(self) -> None:
        if self._prepared:
            return
        try:
            self.store.prepare(self.identity)
        except OSError as exc:  # writing the claim, putting back a replaced copy, listing
            raise CheckpointStorageError(
                f"cannot claim checkpoint directory {self.store.root}: {describe_failure(exc)}"
            ) from None
        self._prepared = True
        self._heartbeat = threads.start(self._beat, name="checkpoint-heartbeat", stop=self._closing.set)
        atexit.register(self.stop)  # if stop() is never reached

    def stop(self) -> None:
        """Stop and join the heartbeat thread (see the module docstring)."""
        self._closing.set()
        if self._heartbeat is not None and self._heartbeat.is_alive():
            self._heartbeat.join(timeout=5.0)
        atexit.unregister(self.stop)

    def release(self) -> None:
        """The job ended: mark the claim as such (after `stop`), so another job takes the directory at
        once instead of waiting out the heartbeat; a storage error is one warning (it then waits)."""
        if not self._prepared:
            return
        try:
            self.store.release(self.identity)
        except OSError as exc:
            logger.warning("could not mark the claim on %s as ended: %s", self.store.root, describe_failure(exc))

    def _beat(self) -> None:
        interval = self.identity.stale_after / 4
        while not self._closing.wait(interval):
            try:
                self.store.heartbeat(self.identity)
            except SaveFailed:
                return  # another writer took the directory: the next commit says so
            except OSError as exc:
                logger.debug("heartbeat on %s failed: %s", self.store.root, exc)
