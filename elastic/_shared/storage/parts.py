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
import logging
import os
import re
import uuid
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import crc32c
import torch

from elastic._shared.common.errors import CorruptCheckpoint
from elastic._shared.storage import validate
from elastic._shared.storage.chunks import (
    StoredChunk,
    block_checksums,
    dtype_named,
    placed_chunk,
    tensor_declaration,
)
from elastic._shared.storage.manifest import shard_file

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

logger = logging.getLogger(__name__)

PART_FORMAT = 1
HEADER_SUFFIX = ".json"
DATA_SUFFIX = ".bin"
_PART_NAME = re.compile(r"^rank_(\d{5})\.([0-9a-f]{1,16}-[0-9a-f]{1,32})\.s([01])\.(json|bin)$")
_WRITER = re.compile(r"^[0-9a-f]{1,16}-[0-9a-f]{1,32}$")
"""`new_writer_id`'s form: a part's file names are built from it, and its pid read back."""
MAX_WORLD_SIZE = 100_000
"""Part names hold the rank in five digits."""
MAX_HEADER_BYTES = 16 * 2**20
"""The largest part header read (from /dev/shm or a peer). A header lists every chunk its rank
holds (a few hundred bytes each, plus a checksum per MiB) and the rank's trainer state: this is
room for tens of thousands of tensors, and bounds what a crafted one costs."""
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

    def to_json(self, rendered: dict[str, str] | None = None) -> bytes:
        """The header as JSON. `rendered`: fields whose JSON text is made already, used in place of
        theirs (a writer renders what does not change from one snapshot to the next once:
        snapshot_slots.Slot; a header of thousands of tensors is megabytes of JSON)."""
        # Not dataclasses.asdict: it deep-copies every chunk's checksums, on every step's snapshot.
        if not rendered:
            return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, sort_keys=True).encode()
        rest = json.dumps({f.name: getattr(self, f.name) for f in fields(self) if f.name not in rendered}, sort_keys=True)
        return (rest[:-1] + "".join(f", {json.dumps(name)}: {text}" for name, text in rendered.items()) + "}").encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> PartHeader:
        """The header in `raw`, checked whole; `CorruptCheckpoint` naming what is wrong if it is not one.

        Checked: every field's type and range (`0 <= rank < world_size`, slot 0 or 1,
        `writer` as `new_writer_id` makes it), every tensor's dtype and size, every chunk
        within its tensor and within the first `data_bytes` of the data file."""
        data = validate.parse_json(raw, "snapshot part header", MAX_HEADER_BYTES)
        fmt = data.get("format")
        if type(fmt) is not int or fmt != PART_FORMAT:
            raise CorruptCheckpoint(f"snapshot part has format {fmt!r}, this runtime reads {PART_FORMAT}")
        unknown = data.keys() - _FIELDS
        if unknown:
            raise CorruptCheckpoint(f"snapshot part header has unknown fields {sorted(unknown)[:5]}")
        what = "snapshot part header"

        def need(key: str) -> Any:
            return validate.need_key(data, key, what)

        world_size = validate.need_int(need("world_size"), f"{what}'s world_size", lo=1, hi=MAX_WORLD_SIZE)
        rank = validate.need_int(need("rank"), f"{what}'s rank", hi=world_size - 1)
        writer = validate.need_str(need("writer"), f"{what}'s writer", max_len=64, pattern=_WRITER)
        slot = validate.need_int(need("slot"), f"{what}'s slot", hi=1)
        what = f"snapshot part {part_stem(rank, writer, slot)}"
        data_bytes = validate.need_int(need("data_bytes"), f"{what}: data_bytes")
        declared = validate.need_dict(need("tensors"), f"{what}: tensors")
        shapes = {fqn: tensor_declaration(md, f"{what}: tensor {fqn[:80]!r}") for fqn, md in declared.items()}
        tensors = {fqn: {"dtype": declared[fqn]["dtype"], "size": list(size)} for fqn, (_, size) in shapes.items()}
        chunks = []
        for i, chunk in enumerate(validate.need_list(need("chunks"), f"{what}: chunks")):
            fqn, at, stored = placed_chunk(chunk, f"{what}: chunk {i}", shapes)
            if stored.offset + stored.length > data_bytes:
                raise CorruptCheckpoint(f"{what}: chunk {i} ends at byte {stored.offset + stored.length}, "
                                        f"beyond its data's {data_bytes}")
            chunks.append({"fqn": fqn, "at": list(at), **stored.to_json()})  # as checked, every field there
        return cls(
            run_id=validate.need_str(need("run_id"), f"{what}: run_id", max_len=1024),
            step=validate.need_int(need("step"), f"{what}: step"),
            rank=rank, world_size=world_size, writer=writer, slot=slot, data_bytes=data_bytes,
            chunks=chunks, tensors=tensors,
            trainer=validate.need_str(need("trainer"), f"{what}: trainer", max_len=MAX_HEADER_BYTES),
            trainer_crc32c=validate.need_int(need("trainer_crc32c"), f"{what}: trainer_crc32c", hi=validate.UINT32 - 1),
            ckpt_dir=validate.need_str(need("ckpt_dir"), f"{what}: ckpt_dir"),
            keep=validate.need_int(need("keep"), f"{what}: keep", lo=1, hi=2**20),
            created=validate.need_float(need("created"), f"{what}: created"),
            format=fmt,
            extra=validate.need_dict(data.get("extra", {}), f"{what}: extra"),
        )


_FIELDS = frozenset(f.name for f in fields(PartHeader))


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
    write_header_bytes(directory, header.stem, header.to_json())


def write_header_bytes(directory: Path, stem: str, head: bytes) -> None:
    """Publish the header JSON `head` of part `stem` in `directory` atomically (temporary file, rename)."""
    tmp = directory / f".{stem}.{uuid.uuid4().hex[:6]}.tmp"
    tmp.write_bytes(head)
    os.replace(tmp, directory / (stem + HEADER_SUFFIX))


def read_headers(directory: Path) -> list[PartHeader]:
    """Every valid part header in `directory` whose data file is there and long enough.

    A header that does not parse, or whose name does not match its contents, is
    skipped with one warning (once per file version); one removed meanwhile silently."""
    found: list[PartHeader] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return found
    for entry in entries:
        parsed = parse_part_name(entry.name)
        if parsed is None or parsed[3] != "json":
            continue
        path = Path(entry.path)
        try:
            header = PartHeader.from_json(validate.read_bounded(path, entry.name, MAX_HEADER_BYTES))
            if (header.rank, header.writer, header.slot) != parsed[:3]:
                raise CorruptCheckpoint(f"snapshot part header {entry.name} describes {header.stem}")
            size = validate.regular_size(directory / (header.stem + DATA_SUFFIX), header.stem + DATA_SUFFIX)
        except FileNotFoundError:
            continue  # overwritten or removed meanwhile: not a part
        except OSError as exc:
            logger.debug("snapshot part %s: %s", entry.name, exc)
            continue
        except CorruptCheckpoint as exc:
            _warn_once(path, str(exc))
            continue
        if size >= header.data_bytes:
            found.append(header)
    return found


_warned: dict[str, tuple[int, int]] = {}


def _warn_once(path: Path, reason: str) -> None:
    """One warning per version (mtime, size) of a bad header: maintenance reads them every few seconds."""
    try:
        info = path.stat()
    except OSError:
        return
    version = (info.st_mtime_ns, info.st_size)
    if _warned.get(str(path)) == version:
        return
    if len(_warned) > 1024:
        _warned.clear()
    _warned[str(path)] = version
    logger.warning("skipping snapshot part header %s: %s", path, reason)


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
    # Imported here: DCP (with DTensor and sympy) is about 1 s of import that the agent, which reads
    # parts, needs only when its keeper commits a breakpoint.
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from elastic._shared.storage import tensors_json

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
            elif (dtype_named(md["dtype"]), torch.Size(md["size"])) != (state[fqn].properties.dtype, state[fqn].size):
                raise CorruptCheckpoint(f"snapshot part {header.stem} declares {fqn[:80]!r} unlike another rank's part")
        for raw in header.chunks:
            stored = StoredChunk.from_json({**raw, "file": shard_file(header.rank)})
            at = torch.Size(raw["at"])
            state[raw["fqn"]].chunks.append(ChunkStorageMetadata(at, torch.Size(stored.sizes)))
            if MetadataIndex(raw["fqn"], at) in storage:
                raise CorruptCheckpoint(f"snapshot part {header.stem} holds {raw['fqn'][:80]!r} at {list(at)} twice")
            storage[MetadataIndex(raw["fqn"], at)] = stored
    metadata = Metadata(state_dict_metadata=state, storage_data=storage)
    # The same checks as a checkpoint's tensors.json: together the parts make up every tensor.
    return tensors_json.metadata_from_json(tensors_json.metadata_to_json(metadata))


def merged_trainer(headers: list[PartHeader]) -> dict[str, Any]:
    """trainer.pt of the checkpoint the parts make up: rank 0's state with every rank's RNG."""
    by_rank = {h.rank: decode_trainer(h) for h in headers}
    if set(by_rank) != set(range(len(by_rank))):
        raise CorruptCheckpoint(f"snapshot parts of ranks {sorted(by_rank)[:8]} are not one of each rank from 0")
    for rank, state in by_rank.items():
        if not isinstance(state, dict) or not isinstance(state.get("rng"), list) or not state["rng"]:
            raise CorruptCheckpoint(f"snapshot part of rank {rank}: its trainer state holds no RNG states")
    trainer = dict(by_rank[0])
    trainer["rng"] = [by_rank[r]["rng"][0] for r in range(len(by_rank))]
    return trainer


def read_data(path: Path, header: PartHeader) -> bytearray:
    """A part's data file, every chunk checked against its crc32c (`CorruptCheckpoint` if one fails)."""
    try:
        with validate.open_regular(path, f"snapshot part {header.stem}") as f:
            if validate.file_size(f) < header.data_bytes:  # never allocate what the file does not hold
                raise CorruptCheckpoint(f"snapshot part {header.stem} is truncated")
            buffer = bytearray(header.data_bytes)
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
