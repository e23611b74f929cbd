"""Snapshot parts: one rank's share of the training state at one step, held in node memory.

A part is what that rank would write into a durable checkpoint (format 2),
kept in two files of a node-local shared-memory directory:

    rank_00003.<writer>.s0.bin    the share's tensors, raw bytes, one after another
    rank_00003.<writer>.s0.json   its header: step, world size, where each chunk lies
                                  with its crc32c per block, the global shape of every
                                  tensor, and the trainer state (sampler, schedule,
                                  extra state, this rank's RNG) as weights-only bytes

`writer` names the worker process (a restarted worker writes files of its own,
so the ones a dead worker left stay intact until the keeper is done with them);
`s0`/`s1` are two slots written in turn, so the previous part is whole while the
next one is written.

Invariants:
- A header exists only for data that was complete when it was written: a writer
  removes a slot's header before it overwrites the slot's data, and writes the
  header (temporary file, rename) after. A reader checks every chunk it reads
  against its crc32c, so a slot overwritten later under a stale header is a
  `CorruptCheckpoint`, never a wrong weight.
- The parts of every rank at one step, put together (`merged_metadata`,
  `merged_trainer`), are exactly a format-2 checkpoint's tensors.json and
  trainer.pt: the durable checkpoint and the restore read the same layout.
- Nothing is pickled: tensors are raw bytes, headers JSON, the trainer state a
  `weights_only` torch.save.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import uuid
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from elastic.errors import CorruptCheckpoint
from elastic.storage import sharded
from elastic.storage.chunks import StoredChunk, block_checksums, dtype_named

PART_FORMAT = 1
HEADER_SUFFIX = ".json"
DATA_SUFFIX = ".bin"
_PART_NAME = re.compile(r"^rank_(\d{5})\.([0-9a-f]+-[0-9a-f]+)\.s([01])\.(json|bin)$")
ALIGN = 64
"""Each tensor starts at a multiple of this in the data file (any dtype's view is aligned)."""


def part_stem(rank: int, writer: str, slot: int) -> str:
    return f"rank_{rank:05d}.{writer}.s{slot}"


def parse_part_name(name: str) -> tuple[int, str, int, str] | None:
    """(rank, writer, slot, "json" | "bin") of a part file's name; None for anything else."""
    match = _PART_NAME.match(name)
    if match is None:
        return None
    return int(match.group(1)), match.group(2), int(match.group(3)), match.group(4)


def new_writer_id() -> str:
    """A name for this worker process's part files, unique on the node and across restarts:
    its pid (hex; the keeper tells live writers from dead ones by it), a dash, a random tag."""
    return f"{os.getpid():x}-{uuid.uuid4().hex[:6]}"


def writer_pid(writer: str) -> int:
    return int(writer.split("-", 1)[0], 16)


@dataclass
class PartHeader:
    """What a reader needs to use a part's data file, and to trust it."""

    run_id: str
    step: int
    rank: int
    world_size: int
    writer: str
    slot: int
    data_bytes: int
    chunks: list[dict[str, Any]]
    """StoredChunk JSON (file named by `shard_file(rank)`) with `fqn` and `at` (global offsets)."""
    tensors: dict[str, dict[str, Any]]
    """Global `dtype` and `size` of every tensor this part holds a chunk of."""
    trainer: str
    """base64 of the weights-only torch.save of this rank's trainer state."""
    trainer_crc32c: int
    ckpt_dir: str
    keep: int
    created: float
    format: int = PART_FORMAT
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def stem(self) -> str:
        return part_stem(self.rank, self.writer, self.slot)

    def to_json(self) -> bytes:
        # Not dataclasses.asdict: it deep-copies every chunk's checksums, on every step's snapshot.
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> PartHeader:
        """The header in `raw`; `CorruptCheckpoint` if it is not one of this format."""
        try:
            data = json.loads(raw)
            if data.get("format") != PART_FORMAT:
                raise CorruptCheckpoint(f"snapshot part has format {data.get('format')!r}, this runtime reads {PART_FORMAT}")
            return cls(**data)
        except CorruptCheckpoint:
            raise
        except (ValueError, TypeError, AttributeError) as exc:
            raise CorruptCheckpoint(f"snapshot part header is unreadable: {type(exc).__name__}: {exc}") from None


def encode_trainer(trainer: dict[str, Any]) -> tuple[str, int]:
    buffer = io.BytesIO()
    torch.save(trainer, buffer)
    raw = buffer.getvalue()
    return base64.b64encode(raw).decode("ascii"), crc32c.crc32c(raw)


def decode_trainer(header: PartHeader) -> dict[str, Any]:
    """The trainer state of a part, checked against its crc32c; loads without executing pickled code."""
    try:
        raw = base64.b64decode(header.trainer.encode("ascii"), validate=True)
    except ValueError:
        raise CorruptCheckpoint(f"snapshot part {header.stem}: its trainer state is not base64") from None
    if crc32c.crc32c(raw) != header.trainer_crc32c:
        raise CorruptCheckpoint(f"snapshot part {header.stem}: its trainer state fails its crc32c check")
    try:
        return torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable state is a corrupt part
        raise CorruptCheckpoint(f"snapshot part {header.stem}: trainer state unreadable ({type(exc).__name__})") from None


def write_header(directory: Path, header: PartHeader) -> None:
    """Publish `header` in `directory` atomically (temporary file, rename)."""
    final = directory / (header.stem + HEADER_SUFFIX)
    tmp = directory / f".{header.stem}.{uuid.uuid4().hex[:6]}.tmp"
    tmp.write_bytes(header.to_json())
    os.replace(tmp, final)


def read_headers(directory: Path) -> list[PartHeader]:
    """Every readable part header in `directory` whose data file is there and long enough."""
    found: list[PartHeader] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return found
    for entry in entries:
        parsed = parse_part_name(entry.name)
        if parsed is None or parsed[3] != "json":
            continue
        try:
            header = PartHeader.from_json(Path(entry.path).read_bytes())
            size = os.stat(directory / (header.stem + DATA_SUFFIX)).st_size
        except (OSError, CorruptCheckpoint):
            continue  # overwritten or removed meanwhile: not a part
        if size >= header.data_bytes and (header.rank, header.writer, header.slot) == parsed[:3]:
            found.append(header)
    return found


# -- a step's parts as one checkpoint ----------------------------------------------


def complete(headers: list[PartHeader]) -> bool:
    """Whether `headers` hold one part of every rank of one step and world size."""
    if not headers:
        return False
    world, step = headers[0].world_size, headers[0].step
    ranks = {h.rank for h in headers if h.world_size == world and h.step == step}
    return ranks == set(range(world)) and len(headers) == world


def merged_metadata(headers: list[PartHeader]) -> Metadata:
    """The DCP metadata of the checkpoint the parts make up; rank r's chunks lie in `shard_file(r)`."""
    state: dict[str, TensorStorageMetadata] = {}
    storage: dict[MetadataIndex, StoredChunk] = {}
    for header in sorted(headers, key=lambda h: h.rank):
        for fqn, md in header.tensors.items():
            if fqn not in state:
                state[fqn] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=dtype_named(md["dtype"])),
                    size=torch.Size(md["size"]),
                    chunks=[],
                )
        for raw in header.chunks:
            stored = StoredChunk.from_json({**raw, "file": sharded.shard_file(header.rank)})
            at = torch.Size(raw["at"])
            state[raw["fqn"]].chunks.append(ChunkStorageMetadata(at, torch.Size(stored.sizes)))
            storage[MetadataIndex(raw["fqn"], at)] = stored
    return Metadata(state_dict_metadata=state, storage_data=storage)


def merged_trainer(headers: list[PartHeader]) -> dict[str, Any]:
    """trainer.pt of the checkpoint the parts make up: rank 0's state with every rank's RNG."""
    by_rank = {h.rank: decode_trainer(h) for h in headers}
    trainer = dict(by_rank[0])
    trainer["rng"] = [by_rank[r]["rng"][0] for r in range(len(by_rank))]
    return trainer


def read_data(path: Path, header: PartHeader) -> bytearray:
    """A part's data file, every chunk checked against its crc32c (`CorruptCheckpoint` if one fails)."""
    buffer = bytearray(header.data_bytes)
    try:
        with open(path, "rb") as f:
            got = f.readinto(buffer)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"snapshot part {header.stem} is gone") from None
    if got != header.data_bytes:
        raise CorruptCheckpoint(f"snapshot part {header.stem} is truncated")
    view = memoryview(buffer)
    for raw in header.chunks:
        offset, length = int(raw["offset"]), int(raw["length"])
        block = int(raw["block"])
        if tuple(block_checksums(view[offset : offset + length], block)) != tuple(raw["crc32c"]):
            raise CorruptCheckpoint(f"snapshot part {header.stem} fails its crc32c check at {raw['fqn']}")
    return buffer
