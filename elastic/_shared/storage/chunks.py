"""One saved chunk of tensor bytes: where it lies, its checksums, and reading it back checked.

A chunk is a run of raw tensor bytes in a shard file (a checkpoint's
`shard_NNNNN.bin`, or a snapshot part's data file), described by a
`StoredChunk`: file, offset, length, dtype, sizes, and a crc32c per `BLOCK`
bytes. This module reads a chunk (or some of its rows) and checks every block
it reads; sharded.py puts chunks together into tensors through DCP.

Invariants:
- Every block read is checked against its crc32c before its bytes are used: a
  torn or flipped byte is a `CorruptCheckpoint` naming the file, never a
  silently wrong weight, whatever the source of the bytes (a file, a map, a peer).
- Of a chunk split along its first dimension (FSDP2's rows) only the blocks
  that hold the rows asked for are read.
- Bytes may come from a `ChunkSource` instead of a file: snapshot parts in
  memory through maps (`MappedFiles`, one copy fewer), or on another node over
  HTTP (checkpoint.part_files.PartFiles). Never maps of files on storage: a read
  error there would be a SIGBUS instead of an `OSError`.
"""

from __future__ import annotations

import math
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import crc32c
import torch

from elastic._shared.common.errors import CorruptCheckpoint
from elastic._shared.storage import validate

BLOCK = 2**20
"""Bytes per checksum when writing (each chunk records its own): large chunks are checked in
blocks on several threads, and a reader that needs some rows reads only their blocks."""

_checksum_pools: dict[int, ThreadPoolExecutor] = {}


def _checksum_pool() -> ThreadPoolExecutor:
    """This process's checksum threads. One per process: a forked child inherits the parent's
    executor without its threads, and work submitted to it would wait forever."""
    pool = _checksum_pools.get(os.getpid())
    if pool is None:
        pool = ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="crc32c")
        _checksum_pools.clear()
        _checksum_pools[os.getpid()] = pool
    return pool


def block_checksums(data: memoryview, block: int | None = None) -> list[int]:
    """crc32c of each `block` bytes (default `BLOCK`) of `data`; in parallel (crc32c releases the GIL)."""
    block = block or BLOCK
    blocks = [data[i : i + block] for i in range(0, len(data), block)] or [data]
    if len(blocks) == 1:
        return [crc32c.crc32c(blocks[0])]
    return list(_checksum_pool().map(crc32c.crc32c, blocks))


PARALLEL_BYTES = 16 * 2**20
"""`pieces_checksums` checksums fewer bytes than this on the calling thread: below it, handing
blocks to the pool costs more than it saves (crc32c runs at 10+ GB/s)."""


def _timed_crc(block: memoryview) -> tuple[int, float]:
    started = time.thread_time()
    return crc32c.crc32c(block), time.thread_time() - started


def pieces_checksums(pieces: list[memoryview], block: int = BLOCK) -> tuple[list[tuple[int, ...]], float]:
    """`block_checksums` of every piece, and the CPU seconds the pool's threads spent on them (0 when
    the calling thread ran them all, whose own clock then has them): a background writer's cost is
    counted whole. One pass for all pieces: on the calling thread when they hold fewer than
    `PARALLEL_BYTES`, else on the pool."""
    counts = [max(1, -(-len(p) // block)) for p in pieces]  # an empty piece has one checksum, as in block_checksums
    if sum(len(p) for p in pieces) < PARALLEL_BYTES:
        return [tuple(crc32c.crc32c(p[i * block : (i + 1) * block]) for i in range(n)) for p, n in zip(pieces, counts)], 0.0
    blocks = [p[i * block : (i + 1) * block] for p, n in zip(pieces, counts) for i in range(n)]
    results = list(_checksum_pool().map(_timed_crc, blocks))
    cpu = sum(seconds for _, seconds in results)
    out, at = [], 0
    for n in counts:
        out.append(tuple(crc for crc, _ in results[at : at + n]))
        at += n
    return out, cpu


def dtype_named(name: Any) -> torch.dtype:
    """The torch dtype called `name` ("torch.float32" or "float32"); `CorruptCheckpoint` for anything else."""
    dtype = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpoint(f"an unknown dtype {str(name)[:80]!r}")
    return dtype


@dataclass(frozen=True)
class StoredChunk:
    """Where one saved chunk lies and how to check it."""

    file: str
    offset: int
    length: int
    dtype: str
    sizes: tuple[int, ...]
    crc32c: tuple[int, ...]
    block: int
    """Bytes each crc32c covers (the last block may be shorter)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file, "offset": self.offset, "length": self.length, "dtype": self.dtype,
            "sizes": list(self.sizes), "crc32c": list(self.crc32c), "block": self.block,
        }

    @classmethod
    def from_json(cls, raw: Any, what: str = "a chunk") -> StoredChunk:
        """The chunk `raw` describes, checked (`CorruptCheckpoint` naming `what` if it is not one):
        a bare file name, a known dtype, `length` the bytes of `sizes` of that dtype, and one
        uint32 crc32c per `block` bytes (one for an empty chunk)."""
        raw = validate.need_dict(raw, what)
        # The first format-2 checkpoints used 16 MiB blocks and did not say.
        block = validate.need_int(raw.get("block", 16 * 2**20), f"{what}'s block", lo=1)
        dtype_name = validate.need_str(validate.need_key(raw, "dtype", what), f"{what}'s dtype", max_len=64)
        dtype = dtype_named(dtype_name)
        sizes = validate.need_ints(validate.need_key(raw, "sizes", what), f"{what}'s sizes")
        length = validate.need_int(validate.need_key(raw, "length", what), f"{what}'s length")
        if length != math.prod(sizes) * dtype.itemsize:
            raise CorruptCheckpoint(f"{what} is {length} bytes long, its sizes {list(sizes)} of {dtype_name} make "
                                    f"{math.prod(sizes) * dtype.itemsize}")
        checksums = validate.need_list(validate.need_key(raw, "crc32c", what), f"{what}'s crc32c")
        if len(checksums) != max(1, -(-length // block)):
            raise CorruptCheckpoint(f"{what} has {len(checksums)} checksums for {length} bytes in blocks of {block}")
        return cls(
            file=validate.need_name(validate.need_key(raw, "file", what), f"{what}'s file"),
            offset=validate.need_int(validate.need_key(raw, "offset", what), f"{what}'s offset"),
            length=length, dtype=dtype_name, sizes=sizes,
            crc32c=validate.need_ints(checksums, f"{what}'s crc32c", hi=validate.UINT32 - 1), block=block,
        )


def tensor_declaration(raw: Any, what: str) -> tuple[torch.dtype, tuple[int, ...]]:
    """(dtype, global size) of a tensor's `{"dtype", "size"}` record, checked."""
    raw = validate.need_dict(raw, what)
    dtype = dtype_named(validate.need_key(raw, "dtype", what))
    size = validate.need_ints(validate.need_key(raw, "size", what), f"{what}'s size")
    if math.prod(size) > validate.MAX_INT:
        raise CorruptCheckpoint(f"{what} has size {list(size)}, more elements than any tensor holds")
    return dtype, size


def placed_chunk(
    raw: Any, what: str, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]
) -> tuple[str, tuple[int, ...], StoredChunk]:
    """(fqn, global offset `at`, chunk) of a chunk record `{"fqn", "at", ...StoredChunk}`, checked
    against the tensor it belongs to (`tensors`: fqn -> dtype, global size): same dtype, same
    number of dimensions, and lying within the tensor."""
    raw = validate.need_dict(raw, what)
    fqn = validate.need_str(validate.need_key(raw, "fqn", what), f"{what}'s fqn")
    if fqn not in tensors:
        raise CorruptCheckpoint(f"{what} belongs to {fqn[:80]!r}, which is not declared")
    dtype, size = tensors[fqn]
    at = validate.need_ints(validate.need_key(raw, "at", what), f"{what}'s at")
    stored = StoredChunk.from_json(raw, what)
    if dtype_named(stored.dtype) != dtype:
        raise CorruptCheckpoint(f"{what} holds {stored.dtype}, its tensor {fqn[:80]!r} is {dtype}")
    if len(at) != len(size) or len(stored.sizes) != len(size):
        raise CorruptCheckpoint(f"{what} at {list(at)} of sizes {list(stored.sizes)} does not fit {fqn[:80]!r} of size {list(size)}")
    if any(a + n > s for a, n, s in zip(at, stored.sizes, size)):
        raise CorruptCheckpoint(f"{what} at {list(at)} of sizes {list(stored.sizes)} lies outside {fqn[:80]!r} of size {list(size)}")
    return fqn, at, stored


def read_chunk(directory: Path, stored: StoredChunk, fqn: str) -> torch.Tensor:
    """One saved chunk as a CPU tensor, after its checksums pass (`CorruptCheckpoint` if not)."""
    return read_rows(directory, stored, fqn, None)[0]


class ChunkSource(Protocol):
    """Where a reader takes a chunk's bytes from, instead of reading the file itself."""

    def expect(self, spans: list[tuple[str, int, int]]) -> None:
        """The (file, start, stop) spans about to be read, in order (a hint: batch, read ahead)."""

    def view(self, file: str, start: int, stop: int) -> memoryview | bytearray | None:
        """Bytes [start, stop) of `file`; None if the file is shorter. `FileNotFoundError`
        if it is missing, another `OSError` if it cannot be had."""

    def close(self) -> None:
        """Once no view is left."""


class MappedFiles:
    """Private read maps of a directory's data files, one per file, made on first use.

    For files in memory only (tmpfs; `memory.in_memory`): a chunk is then checked and
    copied straight from the page it lies in, with no read into a buffer first. The
    file's size is checked when it is mapped, so a short file is a `CorruptCheckpoint`;
    the files must not shrink or change while mapped (snapshot parts at restore never
    do: their writers, the only ones to rewrite a part, local or replica, in place, are
    gone; a part of another size replaces its file by rename; pruning unlinks).
    Close once no view of a chunk is left. A symbolic link is refused unless `follow_links`
    (a restore's own layout of links to this node's parts, memory.gather_files)."""

    def __init__(self, directory: Path, *, follow_links: bool = False) -> None:
        self.directory = directory
        self.follow_links = follow_links
        self._maps: dict[str, mmap.mmap | None] = {}

    def expect(self, spans: list[tuple[str, int, int]]) -> None:
        pass  # the pages are already in memory

    def view(self, file: str, start: int, stop: int) -> memoryview | None:
        """Bytes [start, stop) of `file`, or None if the file is shorter (or empty)."""
        if file not in self._maps:
            with validate.open_regular(self.directory / file, file, follow_link=self.follow_links) as f:
                size = validate.file_size(f)
                # ACCESS_COPY: writable to Python (torch.frombuffer wants that), never written back.
                self._maps[file] = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None
        mapping = self._maps[file]
        if stop > (len(mapping) if mapping is not None else 0):
            return None
        return memoryview(mapping)[start:stop] if mapping is not None else memoryview(b"")

    def close(self) -> None:
        for mapping in self._maps.values():
            if mapping is not None:
                try:
                    mapping.close()
                except BufferError:  # a view still alive: the map goes with it
                    pass
        self._maps.clear()


def _layout(stored: StoredChunk, rows: tuple[int, int] | None) -> tuple[int, int, int, int, int, int]:
    """(lo, hi): the bytes of the rows within the chunk; (first_block, end_block): the checksum
    blocks that hold them; (start, stop): those blocks' bytes within the chunk."""
    row_bytes = stored.length // stored.sizes[0] if stored.sizes and stored.sizes[0] else stored.length
    first_row, end_row = rows if rows is not None else (0, stored.sizes[0] if stored.sizes else 1)
    lo, hi = first_row * row_bytes, end_row * row_bytes
    if rows is None:
        lo, hi = 0, stored.length
    first_block, end_block = lo // stored.block, -(-hi // stored.block) if hi else 0
    start, stop = first_block * stored.block, min(end_block * stored.block, stored.length)
    return lo, hi, first_block, end_block, start, stop


def chunk_span(stored: StoredChunk, rows: tuple[int, int] | None) -> tuple[str, int, int]:
    """(file, start, stop): the bytes `read_rows` reads for these rows of the chunk."""
    *_, start, stop = _layout(stored, rows)
    return stored.file, stored.offset + start, stored.offset + stop


def read_rows(
    directory: Path, stored: StoredChunk, fqn: str, rows: tuple[int, int] | None, *, source: ChunkSource | None = None
) -> tuple[torch.Tensor, int]:
    """Rows [first, end) of a saved chunk (None: all of it) as a CPU tensor, and the bytes read.

    Only the checksum blocks that hold those rows are read, and each is checked
    (`CorruptCheckpoint` if one fails). With a `source` the bytes come from it (the
    tensor may be a view of them, valid until the source is closed)."""
    where = f"{directory.name}/{stored.file}"
    dtype = dtype_named(stored.dtype)
    first_row, end_row = rows if rows is not None else (0, stored.sizes[0] if stored.sizes else 1)
    lo, hi, first_block, end_block, start, stop = _layout(stored, rows)
    buffer: bytearray | memoryview
    try:
        if source is not None:
            view = source.view(stored.file, stored.offset + start, stored.offset + stop)
            buffer, got = (view, len(view)) if view is not None else (bytearray(), -1)
        else:
            with validate.open_regular(directory / stored.file, where) as f:
                # Never allocate more than the file holds: a declared length is not trusted.
                if validate.file_size(f) < stored.offset + stop:
                    buffer, got = bytearray(), -1
                else:
                    buffer = bytearray(stop - start)
                    f.seek(stored.offset + start)
                    got = f.readinto(buffer)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{where} is missing") from None
    if got != len(buffer):
        raise CorruptCheckpoint(f"{where} is truncated: {fqn} needs bytes {stored.offset}..{stored.offset + stored.length}")
    expected = stored.crc32c[first_block:end_block] if stored.length else stored.crc32c
    if tuple(block_checksums(memoryview(buffer), stored.block)) != tuple(expected):
        raise CorruptCheckpoint(f"{where} fails its crc32c check at {fqn}")
    if hi == lo:
        shape = (0, *stored.sizes[1:]) if rows is not None else stored.sizes
        return torch.empty(shape, dtype=dtype), len(buffer)
    raw = torch.frombuffer(buffer, dtype=torch.uint8, offset=lo - start, count=hi - lo)
    shape = (end_row - first_row, *stored.sizes[1:]) if rows is not None else stored.sizes
    return raw.view(dtype).reshape(shape), len(buffer)
