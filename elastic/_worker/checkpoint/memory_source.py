"""Restoring from the in-memory snapshots the nodes' keepers hold (memory.py writes them).

Invariants:
- Every rank reports what its node holds (`gather`, a collective); rank 0
  offers the newest step whose every old rank's part some node holds, of one
  generation (the restore its writers resumed from: parts a dead timeline left
  at the same step never mix with the live one's), no older than the newest
  checkpoint on disk, and fitting this run. It offers at most one: if it
  cannot be read, the restore goes to disk.
- The offer is "memory" when every part is where its own worker wrote it,
  "peer" when some survive only as replicas on another node.
- Opening an offer lays out this rank's parts (symlinks to this node's, range
  requests to other nodes' keepers); fetching gets half the restore's time
  left, so the fallback to disk has the rest.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from elastic._shared.common.errors import CheckpointMismatchError, CorruptCheckpoint
from elastic._shared.storage import parts, tensors_json
from elastic._shared.storage.keeper_address import LOCAL, REPLICA
from elastic._shared.storage.manifest import Manifest, checkpoint_name, versions
from elastic._shared.storage.parts import PartHeader
from elastic._worker.checkpoint import fit
from elastic._worker.checkpoint.memory import Inventory, MemorySnapshots
from elastic._worker.checkpoint.sources import MEMORY, PEER, Offer, Opened
from elastic._worker.checkpoint.training_state import TrainingState
from elastic._worker.control import agreement
from elastic._worker.runtime.context import WorkerContext

logger = logging.getLogger(__name__)


class MemorySource:
    """This job's snapshots in node memory (see the module docstring)."""

    kind = MEMORY
    storage_errors_fall_back = True

    def __init__(
        self, ctx: WorkerContext, memory: MemorySnapshots, state: TrainingState, *, ckpt_dir: str, tag: str,
        newest_on_disk: int, deadline: float, group: Any = agreement.DEFAULT_GROUP,
    ) -> None:
        """`group`: the ranks' group for the lookup (default: the runtime's control group)."""
        self._ctx = ctx
        self._group = group
        self.memory = memory
        self.state = state
        self._ckpt_dir = ckpt_dir
        self._tag = tag
        self._newest_on_disk = newest_on_disk
        self._deadline = deadline
        self._gathered: list[Inventory] | None = None

    def gather(self) -> None:
        """Every rank (a collective): learn the other nodes' keepers and tell rank 0 what this node holds."""
        self.memory.connect(self._group)
        self._gathered = agreement.gather_to_main(self._ctx, self.memory.inventory(), Inventory, self._group)

    def offers(self) -> Iterator[Offer]:
        offer = self._plan(self._gathered or [])
        if offer is not None:
            yield offer

    def _plan(self, gathered: list[Inventory]) -> Offer | None:
        places: dict[tuple[int, int, str], dict[int, list[list[str]]]] = {}
        headers: dict[tuple[int, int, str], dict[int, PartHeader]] = {}
        for node in gathered:
            for entry in node.parts:
                try:
                    where, raw = _inventory_entry(entry)
                    header = PartHeader.from_json(raw)
                except CorruptCheckpoint as exc:
                    logger.warning("skipping a snapshot part that node %s reports: %s", node.node, exc)
                    continue  # never planned on
                if header.ckpt_dir != self._ckpt_dir:
                    continue  # another job's (one keeper may serve several in one process)
                key = (header.step, header.world_size, str(header.extra.get("generation", "")))
                chosen = headers.setdefault(key, {}).setdefault(header.rank, header)
                if header.stem == chosen.stem:  # the file each rank reads is the header's own
                    places.setdefault(key, {}).setdefault(header.rank, []).append([node.node, node.url, where, header.stem])
        for step, world_size, generation in newest_first(places, headers):
            if step < self._newest_on_disk:
                break
            found = places[(step, world_size, generation)]
            if set(found) != set(range(world_size)):
                continue
            name = f"the in-memory snapshot of step {step}"
            try:
                chosen_headers = [headers[(step, world_size, generation)][rank] for rank in range(world_size)]
                metadata = parts.merged_metadata(chosen_headers)
                trainer = parts.merged_trainer(chosen_headers)
                fit.check_fits(name, metadata, trainer, self.state)
                sampler = trainer["sampler"]
                manifest = Manifest(
                    step=step, epoch=int(sampler["epoch"]), consumed=int(sampler["consumed"]), world_size=world_size,
                    files={}, created=time.time(), reason="snapshot", run_id=self._ctx.run_id, versions=versions(),
                )
            # The trainer state came from peers (checked against its crc32c, loaded weights-only):
            # one not shaped as this runtime writes it is a part to skip, like a corrupt one.
            except (CorruptCheckpoint, CheckpointMismatchError, KeyError, TypeError, ValueError, IndexError,
                    AttributeError) as exc:
                logger.warning("%s cannot be restored (%s); trying an older one", name, _one_line(exc))
                continue
            local = all(any(place[2] == LOCAL for place in found[rank]) for rank in found)
            return Offer(
                source=MEMORY if local else PEER, name=name, checkpoint=checkpoint_name(step),
                manifest=manifest.to_json(), trainer=trainer, tensors_json=tensors_json.metadata_to_json(metadata),
                locations=found,
            )
        return None

    def open(self, offer: Offer) -> Opened:
        assert offer.locations is not None
        now = time.monotonic()
        directory = self.memory.restore_directory(self._tag)
        try:
            # Fetching from other nodes gets half the time left: the disk fallback needs the rest.
            files = self.memory.gather_files(offer.locations, self._tag, fetch_deadline=now + (self._deadline - now) / 2)
        except OSError:
            _remove(directory)
            raise
        return Opened(
            files.directory, files, bytes_fetched=lambda: files.bytes_fetched, cleanup=lambda: _remove(files.directory),
        )

    def rejected(self, offer: Offer, reason: str) -> None:
        logger.warning("%s cannot be restored (%s); restoring from disk", offer.name, reason)

    def restored(self, offer: Offer) -> None:
        pass


def _remove(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


def newest_first(keys: Any, headers: dict[tuple[int, int, str], dict[int, PartHeader]]) -> list[tuple[int, int, str]]:
    """The snapshots (step, world size, generation) in the order to offer them: the newest step first, and
    of two timelines at the same step the one written last (a round that trained on from an older step, at
    another size, wrote its own step N after the dead timeline's: resuming the dead one's would drop the
    live one's steps, and the samples it trained would look trained twice)."""
    def written(key: tuple[int, int, str]) -> float:
        return max((header.created for header in headers.get(key, {}).values()), default=0.0)

    return sorted(keys, key=lambda key: (key[0], written(key), key[1]), reverse=True)


def _inventory_entry(entry: object) -> tuple[str, str]:
    """(where, header JSON) of one entry of a node's inventory; `CorruptCheckpoint` if it is not one."""
    if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and all(isinstance(x, str) for x in entry)):
        raise CorruptCheckpoint(f"an inventory entry {str(entry)[:80]!r} is not [where, header]")
    if entry[0] not in (LOCAL, REPLICA):  # a place in the keeper's directory, never a path
        raise CorruptCheckpoint(f"an inventory entry places a part in {entry[0][:80]!r}")
    return entry[0], entry[1]


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
