"""A checkpoint's tensors.json: DCP's metadata as our own JSON, written and read back checked.

It names every saved tensor's dtype, global shape and chunks, and where each chunk lies (file,
offset, length) with its crc32c per block (chunks.py); the sharded format (sharded.py) writes it
once per save and every restore plans from it.

Invariants:
- It is JSON, never DCP's pickled `.metadata`: reading a checkpoint never unpickles anything.
- What is read is untrusted (validate.py): at most `MAX_TENSORS_JSON_BYTES`, checked whole
  (`metadata_from_json`): each tensor's declared chunks are exactly the stored ones and make up its
  size, and with the manifest's file sizes every chunk lies within its file; anything else is a
  `CorruptCheckpoint`.
- `metadata_from_json(metadata_to_json(m)) == m`; only tensors are written (a byte item is refused).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from elastic._shared.common.errors import CorruptCheckpoint
from elastic._shared.storage import validate
from elastic._shared.storage.chunks import StoredChunk, placed_chunk, tensor_declaration
from elastic._shared.storage.manifest import TENSORS_FILE

TENSORS_FORMAT = 1
MAX_TENSORS_JSON_BYTES = 2**30
"""The largest tensors.json read: its size is in the manifest, checked before it is read; this
bounds a crafted one (real ones hold a few hundred bytes per chunk and a checksum per MiB)."""


def metadata_to_json(metadata: Metadata) -> str:
    tensors: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"{fqn} is not a tensor; checkpoints store tensors only")
        tensors[fqn] = {
            "dtype": str(md.properties.dtype),
            "size": list(md.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
        }
    chunks = [
        {"fqn": index.fqn, "at": list(index.offset or ()), **stored.to_json()}
        for index, stored in metadata.storage_data.items()
    ]
    return json.dumps({"format": TENSORS_FORMAT, "tensors": tensors, "chunks": chunks}, sort_keys=True) + "\n"


def metadata_from_json(text: str | bytes, file_sizes: Mapping[str, int] | None = None) -> Metadata:
    """The DCP metadata in `text`; `CorruptCheckpoint` if it is not one.

    Checked whole: every tensor's dtype and size, its declared chunks exactly the
    stored ones (`chunks.placed_chunk`) and together as many elements as the tensor.
    With `file_sizes` (file -> bytes, from a manifest whose sizes were checked), every
    chunk lies in one of those files and within its size."""
    raw = validate.parse_json(text, TENSORS_FILE, MAX_TENSORS_JSON_BYTES)
    if type(raw.get("format")) is not int or raw["format"] != TENSORS_FORMAT:
        raise CorruptCheckpoint(f"{TENSORS_FILE} has format {raw.get('format')!r}, this runtime reads {TENSORS_FORMAT}")
    declared = validate.need_dict(validate.need_key(raw, "tensors", TENSORS_FILE), f"{TENSORS_FILE}'s tensors")
    shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    pieces: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for fqn, md in declared.items():
        what = f"{TENSORS_FILE}: tensor {fqn[:80]!r}"
        shapes[fqn] = tensor_declaration(md, what)
        pieces[fqn] = []
        for i, c in enumerate(validate.need_list(validate.need_key(md, "chunks", what), f"{what}'s chunks")):
            c = validate.need_dict(c, f"{what}'s chunk {i}")
            offsets = validate.need_ints(validate.need_key(c, "offsets", what), f"{what}'s chunk {i} offsets")
            pieces[fqn].append((offsets, validate.need_ints(validate.need_key(c, "sizes", what), f"{what}'s chunk {i} sizes")))
    storage: dict[MetadataIndex, StoredChunk] = {}
    stored_pieces: dict[str, set[tuple[tuple[int, ...], tuple[int, ...]]]] = {fqn: set() for fqn in shapes}
    records = validate.need_list(validate.need_key(raw, "chunks", TENSORS_FILE), f"{TENSORS_FILE}'s chunks")
    for i, c in enumerate(records):
        what = f"{TENSORS_FILE}: chunk {i}"
        fqn, at, stored = placed_chunk(c, what, shapes)
        if file_sizes is not None and stored.offset + stored.length > file_sizes.get(stored.file, -1):
            raise CorruptCheckpoint(f"{what} lies at {stored.file} bytes {stored.offset}..{stored.offset + stored.length}, "
                                    "beyond the files of its checkpoint")
        index = MetadataIndex(fqn, torch.Size(at))
        if index in storage:
            raise CorruptCheckpoint(f"{what} is a second chunk of {fqn[:80]!r} at {list(at)}")
        storage[index] = stored
        stored_pieces[fqn].add((at, stored.sizes))
    state = {}
    for fqn, (dtype, size) in shapes.items():
        if len(set(pieces[fqn])) != len(pieces[fqn]) or set(pieces[fqn]) != stored_pieces[fqn]:
            raise CorruptCheckpoint(f"{TENSORS_FILE}: the chunks declared for {fqn[:80]!r} are not the chunks stored")
        if sum(math.prod(sizes) for _, sizes in pieces[fqn]) != math.prod(size):
            raise CorruptCheckpoint(f"{TENSORS_FILE}: the chunks of {fqn[:80]!r} do not make up its size {list(size)}")
        state[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype), size=torch.Size(size),
            chunks=[ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in pieces[fqn]],
        )
    return Metadata(state_dict_metadata=state, storage_data=storage)


def tensor_shapes(metadata: Metadata) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Global shape and dtype of every saved tensor, by key."""
    return {
        fqn: (md.size, md.properties.dtype)
        for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
