"""Tensor storage of a checkpoint on torch.distributed.checkpoint (DCP), without pickles.

DCP plans who writes what (each rank its own shards; replicated tensors go to
the one rank `owners` assigns them) and, on load, which saved chunks overlap
each rank's target tensors, so a state saved at one world size loads at
another. This module is the storage under it:

    <checkpoint>/shard_00000.bin   rank 0's items, raw bytes, one after another
    <checkpoint>/shard_00001.bin   rank 1's items
    <checkpoint>/tensors.json      DCP's metadata: every tensor's global shape and
                                   chunks, and where each chunk lies, with its checksums

Invariants:
- Nothing is pickled: chunks are the tensors' raw bytes, the metadata is JSON.
  DCP's own format pickles its `.metadata` and loads byte items with
  `weights_only=False`; neither happens here (byte items are refused).
- Every chunk carries a crc32c per `chunks.BLOCK` bytes, computed while it is
  written and checked when it is read (chunks.py), so a torn or flipped byte is
  a `CorruptCheckpoint` naming the file, never a silently wrong weight.
- A rank reads only the chunks that overlap its own targets, each once, and of
  a chunk split along its first dimension (FSDP2's rows, at another world
  size) only the checksum blocks that hold its rows: a restore that reshards
  reads each byte about once, not once per overlapping rank. It counts the
  bytes it read (`ShardReader.bytes_read`).
- Each rank fsyncs its own file; the coordinator fsyncs tensors.json. The
  commit (atomic rename of the directory) is the store's, after all of it.
- A reader may take its bytes from a `chunks.ChunkSource` instead of reading
  the files (snapshot parts in memory or on another node); checked alike.
- The metadata is our own JSON (tensors_json.py), not DCP's `.metadata`: that
  one is a pickle, which a checkpoint must never make anyone load.
"""

from __future__ import annotations

import io
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
)
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import (
    StorageReader,
    StorageWriter,
    WriteResult,
)
from torch.distributed.checkpoint.utils import CheckpointException
from torch.distributed.tensor import DTensor
from torch.futures import Future

from elastic._shared.common.errors import CorruptCheckpoint
from elastic._shared.storage.chunks import (
    BLOCK,
    ChunkSource,
    StoredChunk,
    block_checksums,
    chunk_span,
    read_chunk,
    read_rows,
)
from elastic._shared.storage.manifest import SHARD_PREFIX, TENSORS_FILE, shard_file  # noqa: F401 - the format's names, here too
from elastic._shared.storage.tensors_json import metadata_to_json, tensor_shapes


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


# -- writing -------------------------------------------------------------------------


class ShardWriter(StorageWriter):
    """Each rank appends its items' raw bytes to its own file, checksumming as it goes."""

    def __init__(
        self,
        directory: Path,
        *,
        after_first_item: Callable[[], None] = lambda: None,
        sink: Callable[[str], Any] | None = None,
    ) -> None:
        super().__init__()
        self.directory = directory if sink is not None else Path(directory)
        self._after_first_item = after_first_item
        self._sink = sink
        """Opens a rank's file elsewhere than `directory` (a bucket's upload: a context manager whose
        clean exit makes the file appear, object_store/transfer.py); None: a local file, fsynced."""
        self.bytes_written = 0
        self.file_sizes: dict[str, int] = {}
        """Coordinator, after `finish`: every rank's file and its size, from what the ranks reported."""
        self.tensors_json = ""
        """Coordinator, after `finish`: the text of tensors.json."""

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.directory = Path(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [replace(plan, storage_data=shard_file(rank)) for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        file_name = plan.storage_data
        if self._sink is None:
            self.directory.mkdir(parents=True, exist_ok=True)
        results: list[WriteResult] = []
        with (open(self.directory / file_name, "wb") if self._sink is None else self._sink(file_name)) as f:
            offset = 0
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    raise ValueError(f"{item.index.fqn} is not a tensor; checkpoints store tensors only")
                tensor = planner.resolve_data(item)
                data = _raw_bytes(tensor.cpu() if tensor.device.type != "cpu" else tensor)
                f.write(data)
                stored = StoredChunk(
                    file_name, offset, len(data), str(tensor.dtype), tuple(tensor.shape),
                    tuple(block_checksums(data, BLOCK)), BLOCK,
                )
                offset += len(data)
                results.append(WriteResult(index=item.index, size_in_bytes=len(data), storage_data=stored))
                if len(results) == 1:
                    self._after_first_item()
            if self._sink is None:
                f.flush()
                os.fsync(f.fileno())
        self.bytes_written = offset
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rank_results in results for r in rank_results}
        self.file_sizes = {shard_file(rank): 0 for rank in range(len(results))}
        for stored in metadata.storage_data.values():
            self.file_sizes[stored.file] = max(self.file_sizes[stored.file], stored.offset + stored.length)
        self.tensors_json = metadata_to_json(metadata)
        if self._sink is not None:
            return  # the commit uploads it (storage/commit.py)
        with open(self.directory / TENSORS_FILE, "w", encoding="utf-8") as f:
            f.write(self.tensors_json)
            f.flush()
            os.fsync(f.fileno())

    def storage_meta(self) -> None:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True


class _SavePlanner(DefaultSavePlanner):
    """The state is already flat, one tensor per key; each replicated one is given by its owner only."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)


def save_tensors(
    tensors: dict[str, torch.Tensor],
    directory: Path,
    *,
    group: dist.ProcessGroup | None,
    after_first_item: Callable[[], None] = lambda: None,
    sink: Callable[[str], Any] | None = None,
) -> ShardWriter:
    """Write this rank's `tensors` into `directory` (a collective over `group`); the writer
    (`bytes_written` here; on the coordinator `file_sizes` of every rank's file). `sink`: how
    the rank's file is opened elsewhere (`store.part_sink`: a bucket's upload).

    Raises DCP's `CheckpointException` on every rank if any rank failed; `first_error` digs out the cause.
    """
    writer = ShardWriter(directory, after_first_item=after_first_item, sink=sink)
    with warnings.catch_warnings():  # alone, DCP warns it saves "in a single process": that is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(tensors, storage_writer=writer, planner=_SavePlanner(), process_group=group, no_dist=group is None)
    return writer


# -- reading -------------------------------------------------------------------------


class _LoadPlanner(DefaultLoadPlanner):
    """Loads into the given tensors in place; byte items (pickles) are refused."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CorruptCheckpoint(f"{read_item.dest_index.fqn} is stored as pickled bytes; refusing to load it")


class ShardReader(StorageReader):
    """Reads the chunks a rank's plan names, checks each chunk's crc32c, copies the overlap.

    `deadline` (time.monotonic) makes a slow filesystem a `TimeoutError` between chunks;
    `after_first_chunk` runs once the first chunk is read (fault injection); `source`
    gives the bytes instead of the files (told first which spans the plan reads).
    """

    def __init__(
        self,
        directory: Path,
        metadata: Metadata,
        *,
        deadline: float | None = None,
        after_first_chunk: Callable[[], None] = lambda: None,
        source: ChunkSource | None = None,
    ) -> None:
        super().__init__()
        self.directory = Path(directory)
        self._metadata = metadata
        self._deadline = deadline
        self._after_first_chunk = after_first_chunk
        self._source = source
        self.bytes_read = 0

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.directory = Path(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_chunk: dict[MetadataIndex, list[ReadItem]] = {}
        for item in plan.items:
            by_chunk.setdefault(item.storage_index, []).append(item)
        # In file order: one pass over each file, each chunk read once.
        order = sorted(by_chunk, key=lambda i: (self._storage[i].file, self._storage[i].offset))
        if self._source is not None:
            self._source.expect([
                chunk_span(self._storage[i], _rows_needed(self._storage[i], by_chunk[i])) for i in order
            ])
        try:
            for index in order:
                if self._deadline is not None and time.monotonic() > self._deadline:
                    raise TimeoutError("reading the checkpoint took longer than the restore deadline")
                stored: StoredChunk = self._storage[index]
                items = by_chunk[index]
                rows = _rows_needed(stored, items)
                chunk, nbytes = read_rows(self.directory, stored, index.fqn, rows, source=self._source)
                if index is order[0]:
                    self._after_first_chunk()
                self.bytes_read += nbytes
                first_row = rows[0] if rows is not None else 0
                for item in items:
                    piece = chunk
                    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                        piece = piece.narrow(dim, start - first_row if dim == 0 else start, length)
                    target = planner.resolve_tensor(item).detach()
                    target.copy_(piece)
                    planner.commit_tensor(item, target)
                del chunk, piece  # no view of the source's bytes outlives its chunk
        finally:
            if self._source is not None:
                self._source.close()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True


def _rows_needed(stored: StoredChunk, items: list[ReadItem]) -> tuple[int, int] | None:
    """The rows [first, end) of the chunk `items` need, when they narrow its first dimension
    only (FSDP2's Shard(0)); None: the whole chunk."""
    if len(stored.sizes) == 0:
        return None
    first, end = stored.sizes[0], 0
    for item in items:
        if any(item.storage_offsets[d] != 0 or item.lengths[d] != stored.sizes[d] for d in range(1, len(stored.sizes))):
            return None
        first = min(first, item.storage_offsets[0])
        end = max(end, item.storage_offsets[0] + item.lengths[0])
    return (first, end) if (first, end) != (0, stored.sizes[0]) else None

def load_tensors(
    targets: dict[str, torch.Tensor],
    directory: Path,
    metadata: Metadata,
    *,
    group: dist.ProcessGroup | None,
    deadline: float | None = None,
    after_first_chunk: Callable[[], None] = lambda: None,
    source: ChunkSource | None = None,
) -> int:
    """Fill this rank's `targets` (CPU tensors or DTensors of CPU shards) from `directory` (a
    collective over `group`); bytes read here. Raises `CheckpointException` on every rank if any
    failed. `source`: where the bytes come from instead of the files (closed afterwards)."""
    reader = ShardReader(directory, metadata, deadline=deadline, after_first_chunk=after_first_chunk, source=source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(targets, storage_reader=reader, planner=_LoadPlanner(), process_group=group, no_dist=group is None)
    return reader.bytes_read


def verify_tensors(directory: Path, metadata: Metadata) -> int:
    """Read and check every chunk (one process; `inspect`); bytes checked."""
    total = 0
    for index, stored in metadata.storage_data.items():
        read_chunk(directory, stored, index.fqn)
        total += stored.length
    return total


def full_tensors(
    directory: Path, metadata: Metadata, keys: Sequence[str], *, source: ChunkSource | None = None
) -> dict[str, torch.Tensor]:
    """Whole CPU tensors for `keys`, assembled from their chunks in one process (no group);
    `source`: where the bytes come from instead of `directory`'s files (a bucket's ranges)."""
    shapes = tensor_shapes(metadata)
    out = {key: torch.empty(shapes[key][0], dtype=shapes[key][1]) for key in keys}
    load_tensors(out, directory, metadata, group=None, source=source)
    return out


# -- errors --------------------------------------------------------------------------


def first_error(exc: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's `CheckpointException` (else `exc`)."""
    if isinstance(exc, CheckpointException):
        failures = exc.failures
        for rank in sorted(failures):
            cause = failures[rank]
            # DCP stores an `(exception, traceback)` pair per rank (older releases: an object with `.exception`).
            if isinstance(cause, tuple) and cause and isinstance(cause[0], BaseException):
                return cause[0]
            return getattr(cause, "exception", cause)
    return exc


def is_bytes_metadata(md: Any) -> bool:
    return isinstance(md, BytesStorageMetadata)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
