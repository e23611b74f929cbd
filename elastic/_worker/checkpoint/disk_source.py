"""Restoring from the committed checkpoints of `--ckpt-dir`, newest first.

Invariants:
- Rank 0 offers a checkpoint only after its manifest, file sizes, trainer.pt
  and tensors.json verify and it fits this run (fit.py); the tensor chunks are
  verified as every rank reads them (loader.py).
- A corrupt checkpoint is reported with a warning naming it, and the previous
  one is tried. Corrupt ones are moved aside only once an older one restored;
  when none verifies, that is one `CheckpointError` and nothing is moved.
- A storage that cannot be read, or lacks the room for the next save, is a
  `CheckpointStorageError`: a restart on broken storage stops at once instead
  of training into the same failure.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from elastic._shared.common.errors import (
    CheckpointError,
    CheckpointStorageError,
    CorruptCheckpoint,
)
from elastic._shared.storage import tensors_json
from elastic._shared.storage.checkpoint_storage import CheckpointStorage
from elastic._shared.storage.durable import describe_failure
from elastic._shared.storage.manifest import TRAINER_FILE, Candidate
from elastic._worker.checkpoint import fit
from elastic._worker.checkpoint.sources import DISK, Offer, Opened
from elastic._worker.checkpoint.training_state import TrainingState

logger = logging.getLogger(__name__)


class DiskSource:
    """The checkpoints of one directory (see the module docstring). `candidates`: rank 0's listing."""

    kind = DISK
    storage_errors_fall_back = False

    def __init__(self, store: CheckpointStorage[Any], state: TrainingState, candidates: list[Candidate]) -> None:
        self.store = store
        self.state = state
        self._candidates = list(candidates)
        self._corrupt: list[str] = []
        self._bad: list[Candidate] = []

    def offers(self) -> Iterator[Offer]:
        for candidate in list(self._candidates):
            try:
                offer = self._offer(candidate)
            except CorruptCheckpoint as exc:
                self._reject(candidate, str(exc))
                continue
            except OSError as exc:
                raise CheckpointStorageError(
                    f"cannot read checkpoints in {self.store.root}: {describe_failure(exc)}"
                ) from None
            yield offer
        if self._corrupt:
            raise CheckpointError(
                f"no checkpoint in {self.store.root} verifies ({len(self._corrupt)} corrupt, newest: {self._corrupt[0]}); "
                "move them away to start from scratch"
            )

    def _offer(self, candidate: Candidate) -> Offer:
        manifest = self.store.read_checked_manifest(candidate)
        self.store.check_sizes(candidate, manifest)
        trainer = self.store.load_state_file(candidate, manifest, TRAINER_FILE)
        metadata = self.store.tensor_metadata(candidate, manifest) if manifest.format >= 2 else None
        try:
            fit.check_fits(candidate.name, metadata, trainer, self.state)
        except (TypeError, KeyError, IndexError, AttributeError, ValueError) as exc:
            # trainer.pt verified against its manifest, yet is not a trainer state of this runtime: crafted.
            raise CorruptCheckpoint(
                f"{candidate.name}/{TRAINER_FILE} is not a trainer state ({type(exc).__name__}: {str(exc)[:80]})"
            ) from None
        self.store.check_room(manifest.total_bytes)  # the next save would not fit
        return Offer(
            source=DISK, name=candidate.name, checkpoint=candidate.name, manifest=manifest.to_json(), trainer=trainer,
            tensors_json=tensors_json.metadata_to_json(metadata) if metadata is not None else None,
            directory=str(candidate.path),
        )

    def open(self, offer: Offer) -> Opened:
        assert offer.directory is not None
        # A directory's files are read in place; a bucket's chunks through ranged requests.
        return Opened(Path(offer.directory), chunks=self.store.chunk_source(offer.directory))

    def rejected(self, offer: Offer, reason: str) -> None:
        for candidate in self._candidates:
            if candidate.name == offer.checkpoint:
                self._reject(candidate, reason)

    def _reject(self, candidate: Candidate, reason: str) -> None:
        logger.warning("checkpoint %s is corrupt (%s); trying the previous one", candidate.path, reason)
        self._corrupt.append(reason)
        self._bad.append(candidate)
        self._candidates = [c for c in self._candidates if c.name != candidate.name]

    def restored(self, offer: Offer) -> None:
        """Move the corrupt newer checkpoints aside (a failure to move one is a warning: the restore succeeded)."""
        for candidate in self._bad:
            try:
                moved = self.store.quarantine(candidate)
            except OSError as exc:
                logger.warning("cannot move corrupt checkpoint %s aside: %s", candidate.path, describe_failure(exc))
                continue
            logger.warning("moved corrupt checkpoint %s aside to %s", candidate.name, moved.name)
