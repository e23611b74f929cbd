"""The snapshot keeper persisting a snapshot into a checkpoint directory through the one commit.

What keeper_bucket.py does in a bucket, with a file system's primitives: every
node's keeper copies the parts it holds into one staging directory per (step,
run, world size, generation) in `--ckpt-dir`, the same name on every node;
whichever keeper then finds every rank's part there, and creates `.commit`
exclusively, commits it through storage.commit, as rank 0 does.

Invariants:
- Each part is checked against its crc32c (parts.read_data) on the way in, and
  lands under its final name by a rename after an fsync; its header is renamed
  in after its data, so a header in the stage always has its data there.
- Only the keeper whose exclusive create of `.commit` succeeded commits; the
  headers it reads back are untrusted (bounded, parsed by `PartHeader.from_json`).
- The commit honours the directory's claim (a keeper commits, stages and prunes
  only where its job writes), and only steps newer than the newest committed
  checkpoint are written.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic._shared.common.errors import CorruptCheckpoint
from elastic._shared.storage import parts
from elastic._shared.storage.claim import check_may_commit
from elastic._shared.storage.commit import commit_checkpoint
from elastic._shared.storage.directory import CheckpointStore
from elastic._shared.storage.durable import SaveFailed
from elastic._shared.storage.manifest import shard_file
from elastic._shared.storage.parts import PartHeader
from elastic._shared.storage.validate import read_bounded

logger = logging.getLogger(__name__)

STAGE_PREFIX = ".snapshot."


class DirectoryPersister:
    """One keeper's persists into checkpoint directories, and the stages it left there.

    Not thread-safe: the keeper calls it under its lock only."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._roots: set[Path] = set()  # where persists went: their stale stages go at close
        self._staged: dict[Path, set[int]] = {}  # stage -> the ranks this keeper copied into it
        self._stage_worlds: dict[Path, int] = {}

    def persist(self, root: Path, *, world_size: int, keep: int, generation: str,
                steps: dict[int, list[tuple[Path, PartHeader]]]) -> list[int]:
        """Copy the newest step of `steps` newer than the newest committed checkpoint into its stage
        under `root`, and commit it if every rank's part is there; the steps committed by this keeper."""
        try:
            check_may_commit(root, self.run_id)  # nothing is staged, committed or pruned where another job writes
        except SaveFailed as exc:
            logger.warning("snapshot keeper: not persisting to %s: %s", root, exc)
            return []
        store = CheckpointStore(root, keep=keep)
        self._roots.add(root)
        committed: list[int] = []
        newest = _newest(store)
        for step in sorted(steps, reverse=True):
            if step <= newest:
                break
            stage = root / f"{STAGE_PREFIX}step_{step:08d}.{_safe(self.run_id)}.w{world_size}.g{_safe(generation)}"
            try:
                stage.mkdir(exist_ok=True)
                for path, header in steps[step]:
                    if _stage_part(stage, path, header):
                        self._staged.setdefault(stage, set()).add(header.rank)
                self._stage_worlds[stage] = world_size
                if try_commit(store, stage, step, world_size):
                    committed.append(step)
                    logger.info("snapshot keeper: persisted the snapshot of step %d to %s", step, root)
                    break
            except (OSError, SaveFailed) as exc:
                logger.warning("snapshot keeper: cannot persist step %d to %s: %s", step, root, exc)
        _remove_old_stages(root, _newest(store), self.run_id)
        return committed

    def remove_unfinished(self, local_ranks: Callable[[int], set[int]]) -> None:
        """At close, in a job of this node alone (its own workers wrote every rank's parts, as
        `local_ranks(world_size)` says), a stage it could not complete never will be; in any other,
        a peer's keeper may still complete it."""
        for stage, world_size in self._stage_worlds.items():
            if stage.is_dir() and not (stage / ".commit").exists() and local_ranks(world_size) >= set(range(world_size)):
                shutil.rmtree(stage, ignore_errors=True)

    def remove_old(self) -> None:
        """At close: the stale stages in every directory this keeper persisted to."""
        for root in self._roots:
            _remove_old_stages(root, _newest(CheckpointStore(root)), self.run_id)


def _stage_part(stage: Path, path: Path, header: PartHeader) -> bool:
    """Copy one verified part into `stage`; False when another keeper (or an earlier persist) copied
    this rank's part, the stage is being committed, or the part is corrupt."""
    done = stage / f"part_{header.rank:05d}.json"
    if done.exists() or (stage / ".commit").exists():
        return False
    try:
        data = parts.read_data(path, header)
    except CorruptCheckpoint as exc:
        logger.warning("snapshot keeper: not persisting a part: %s", exc)
        return False
    tmp = stage / f".{header.stem}.{uuid.uuid4().hex[:6]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, stage / shard_file(header.rank))
    finally:
        tmp.unlink(missing_ok=True)
    tmp_header = stage / f".{done.name}.{uuid.uuid4().hex[:6]}"
    tmp_header.write_bytes(header.to_json())
    os.replace(tmp_header, done)
    return True


def try_commit(store: CheckpointStore, stage: Path, step: int, world_size: int) -> bool:
    """Commit `stage` once every rank's part is in it, if this keeper is the one to (an exclusively
    created `.commit` decides), through the one commit every writer uses (storage.commit)."""
    from elastic._shared.storage import (
        sharded,  # DCP's metadata (about 1 s of import): only when a breakpoint is persisted
    )

    headers_files = [stage / f"part_{rank:05d}.json" for rank in range(world_size)]
    if not all(path.exists() for path in headers_files):
        return False
    try:
        os.close(os.open(stage / ".commit", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False  # another keeper commits it
    try:
        # Bounded: the stage lies in the shared checkpoint directory, where a FIFO would block a plain read.
        headers = [PartHeader.from_json(read_bounded(path, path.name, parts.MAX_HEADER_BYTES)) for path in headers_files]
        metadata = parts.merged_metadata(headers)
        trainer = parts.merged_trainer(headers)
    except CorruptCheckpoint as exc:
        logger.warning("snapshot keeper: step %d cannot be persisted: %s", step, exc)
        shutil.rmtree(stage, ignore_errors=True)
        return False
    for path in headers_files:
        path.unlink()
    if step <= _newest(store):
        shutil.rmtree(stage, ignore_errors=True)
        return False  # the workers committed this step or a newer one meanwhile
    # `.commit` stays until the stage is published (other keepers leave a stage that has one alone).
    final = commit_checkpoint(
        store, stage, step=step, world_size=world_size,
        shard_sizes={shard_file(h.rank): h.data_bytes for h in headers},
        tensors_json=sharded.metadata_to_json(metadata).encode(), trainer=trainer, reason="breakpoint",
        run_id=headers[0].run_id,
    )
    (final / ".commit").unlink(missing_ok=True)
    return True


def _newest(store: Any) -> int:
    """The step of the newest committed checkpoint in `store`; -1 when none (or it cannot be listed)."""
    try:
        committed = store.committed()
    except OSError:
        return -1
    return committed[0].step if committed else -1


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)[:64]


def _remove_old_stages(root: Path, newest: int, run_id: str) -> None:
    """Staging directories of steps no newer than the newest committed checkpoint: never needed again
    (nothing is removed where another job writes now)."""
    try:
        check_may_commit(root, run_id)
    except (SaveFailed, OSError):
        return
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(STAGE_PREFIX + "step_"):
            continue
        try:
            step = int(entry.name[len(STAGE_PREFIX) + 5 :].split(".", 1)[0])
        except ValueError:
            continue
        if step <= newest:
            shutil.rmtree(entry.path, ignore_errors=True)
