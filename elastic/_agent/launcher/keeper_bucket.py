"""The snapshot keeper persisting a snapshot into a bucket (`--ckpt-dir s3://...`) through the one commit.

What keeper.py does in a directory, with a bucket's primitives: every node's
keeper uploads the parts it holds into one attempt folder per (step, world
size, generation), the same name on every node (`stage_name`); whichever
keeper then finds every rank's part there, and wins the create-only
`.commit` marker, commits it through storage.commit, as rank 0 does.

Invariants:
- Every upload is create-only: a part another keeper uploaded first (its
  replica of the same rank) is left as it is, never replaced.
- A part is uploaded only after its data verified against its header's
  crc32c (parts.read_data); its header is uploaded after its data, so a
  header in the stage always has its data there.
- Only the keeper whose create of `.commit` succeeded commits; the headers it
  reads back are untrusted (bounded, parsed by `PartHeader.from_json`).
- The commit honours the claim (a keeper commits only where its job writes)
  and only steps newer than the newest committed checkpoint are written;
  the markers and headers are deleted once committed, and a stage that never
  commits is an orphan the next claim or commit deletes (object_store/bucket.py).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from elastic._shared.common.errors import CorruptCheckpoint
from elastic._shared.storage import parts
from elastic._shared.storage.commit import commit_checkpoint
from elastic._shared.storage.durable import SaveFailed
from elastic._shared.storage.manifest import shard_file
from elastic._shared.storage.object_store.bucket import BucketStage, BucketStore
from elastic._shared.storage.object_store.objects import ConditionFailed, ObjectMissing
from elastic._shared.storage.object_store.transfer import PartUpload
from elastic._shared.storage.parts import PartHeader
from elastic._shared.storage.stores import open_store

logger = logging.getLogger(__name__)

MARKER = ".commit"


def stage_name(run_id: str, world_size: int, generation: str) -> str:
    """The attempt folder every node's keeper uses for one snapshot timeline (a plain name)."""
    return "k" + hashlib.sha256(f"{run_id}\0{world_size}\0{generation}".encode()).hexdigest()[:20]


def persist(ckpt_dir: str, *, run_id: str, world_size: int, keep: int, generation: str,
            steps: dict[int, list[tuple[Path, PartHeader]]]) -> list[int]:
    """Upload the newest step of `steps` this node holds parts of into the bucket, and commit it if
    every rank's part is there (see the module docstring); the steps committed by this keeper."""
    store = open_store(ckpt_dir, keep=keep, check=False)
    assert isinstance(store, BucketStore)
    try:
        store.check_may_commit(run_id)
        committed = store.committed()
    except (SaveFailed, OSError) as exc:
        logger.warning("snapshot keeper: not persisting to %s: %s", ckpt_dir, exc)
        return []
    newest = committed[0].step if committed else -1
    for step in sorted(steps, reverse=True):
        if step <= newest:
            break
        stage = store.begin(step, stage_name(run_id, world_size, generation))
        try:
            for path, header in steps[step]:
                _upload_part(store, stage, path, header)
            if _try_commit(store, stage, step, world_size):
                logger.info("snapshot keeper: persisted the snapshot of step %d to %s", step, ckpt_dir)
                return [step]
        except (OSError, SaveFailed) as exc:
            logger.warning("snapshot keeper: cannot persist step %d to %s: %s", step, ckpt_dir, exc)
    return []


def _upload_part(store: BucketStore, stage: BucketStage, path: Path, header: PartHeader) -> None:
    try:
        data = parts.read_data(path, header)
    except CorruptCheckpoint as exc:
        logger.warning("snapshot keeper: not persisting a part: %s", exc)
        return
    for name, payload in ((shard_file(header.rank), data), (f"part_{header.rank:05d}.json", header.to_json())):
        try:
            with PartUpload(store.objects, stage.key(name)) as upload:
                upload.write(payload)
        except ConditionFailed:
            pass  # another keeper uploaded this rank's part (its replica) first


def _try_commit(store: BucketStore, stage: BucketStage, step: int, world_size: int) -> bool:
    """Commit the stage if every rank's part is there and this keeper wins the `.commit` marker."""
    from elastic._shared.storage import tensors_json  # DCP's metadata: only when a breakpoint is persisted

    present = {o.key.rsplit("/", 1)[-1] for o in store.objects.list(stage.folder + "/")}
    names = [f"part_{rank:05d}.json" for rank in range(world_size)]
    if not all(name in present for name in names) or MARKER in present:
        return False
    try:
        store.objects.put(stage.key(MARKER), b"", create_only=True)
    except ConditionFailed:
        return False  # another keeper commits it
    try:
        headers = [PartHeader.from_json(store.objects.get(stage.key(name), limit=parts.MAX_HEADER_BYTES)[0])
                   for name in names]
        if [(h.rank, h.step, h.world_size) for h in headers] != [(r, step, world_size) for r in range(world_size)]:
            raise CorruptCheckpoint(f"the parts staged for step {step} are not one of each rank of that step")
        metadata = parts.merged_metadata(headers)
        trainer = parts.merged_trainer(headers)
    except (CorruptCheckpoint, ObjectMissing) as exc:
        logger.warning("snapshot keeper: step %d cannot be persisted: %s", step, exc)
        store.abort(stage)
        return False
    commit_checkpoint(
        store, stage, step=step, world_size=world_size,
        shard_sizes={shard_file(h.rank): h.data_bytes for h in headers},
        tensors_json=tensors_json.metadata_to_json(metadata).encode(), trainer=trainer, reason="breakpoint",
        run_id=headers[0].run_id,
    )
    try:
        store.objects.delete([stage.key(name) for name in [*names, MARKER]])
    except OSError:
        pass  # left in a committed folder, they are harmless; nothing reads them
    return True

