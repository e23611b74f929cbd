"""The one way a format-2 checkpoint is committed, by rank 0's saver and by a snapshot keeper alike.

Both arrive with a stage that holds every rank's shard file (a directory, or
a bucket's attempt folder: object_store/bucket.py):
rank 0's saver after the ranks wrote their shards through DCP
(checkpoint/saver.py), a keeper after the keepers copied their nodes'
snapshot parts in (launcher/keeper.py). `commit_checkpoint` then writes
`tensors.json` and `trainer.pt`, builds the manifest from what it wrote and
hands the stage to the store, which checks the claim and renames it into place.

Invariants:
- The manifest names every file of the checkpoint with its size, and the
  small files (tensors.json, trainer.pt) with their crc32c; shard files are
  checked chunk by chunk through tensors.json.
- The claim is honoured: with an `owner` (rank 0) the directory must still be
  that writer's; without one (a keeper) its job's (`run_id`). A writer that
  lost the directory commits nothing there.
- Two writers committing the same step at once is no failure: the second
  finds it committed and verified (directory.CheckpointStore.finish).
- Any failure is `SaveFailed`, one line naming the cause; the stage is removed
  and nothing committed is touched.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic._shared.storage.checkpoint_storage import CheckpointStorage
from elastic._shared.storage.claim import WriterIdentity

if TYPE_CHECKING:
    from elastic._shared.storage.object_store.bucket import BucketStage
from elastic._shared.storage.durable import SaveFailed, describe_failure
from elastic._shared.storage.manifest import (
    TENSORS_FILE,
    TRAINER_FILE,
    Manifest,
    checkpoint_name,
    versions,
)


def commit_checkpoint(
    store: CheckpointStorage[Any],
    stage: Path | BucketStage,
    *,
    step: int,
    world_size: int,
    shard_sizes: Mapping[str, int],
    tensors_json: bytes,
    trainer: dict[str, Any],
    reason: str,
    run_id: str,
    owner: WriterIdentity | None = None,
    before_commit: Callable[[], None] = lambda: None,
) -> Path:
    """Write `tensors_json` and `trainer` (trainer.pt) into `stage`, beside the shard files named
    in `shard_sizes` (file -> bytes), and commit it as checkpoint `step`; its path.

    `trainer` is the checkpoint's trainer state (its `sampler` gives epoch and samples
    consumed). `before_commit` runs once everything is durable, before the rename.
    """
    name = checkpoint_name(step)
    try:
        files: dict[str, dict[str, Any]] = {file: {"bytes": int(size)} for file, size in sorted(shard_sizes.items())}
        files[TENSORS_FILE] = store.write_bytes(stage, TENSORS_FILE, tensors_json)
        files[TRAINER_FILE] = store.write_state_file(stage, TRAINER_FILE, trainer)
    except OSError as exc:
        store.abort(stage)  # type: ignore[arg-type]
        raise SaveFailed(f"cannot write {name} to {store.root}: {describe_failure(exc)}") from exc
    sampler = trainer["sampler"]
    manifest = Manifest(
        step=step, epoch=int(sampler["epoch"]), consumed=int(sampler["consumed"]), world_size=world_size,
        files=files, created=time.time(), reason=reason, run_id=run_id, versions=versions(),
    )
    try:
        return store.finish(stage, manifest, owner=owner, before_commit=before_commit)
    except OSError as exc:  # renaming, or retiring old ones
        store.abort(stage)
        raise SaveFailed(f"cannot commit {name} in {store.root}: {describe_failure(exc)}") from exc
