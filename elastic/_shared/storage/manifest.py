"""What a committed checkpoint is called and what its manifest says.

A checkpoint directory `step_NNNNNNNN/` holds state files and `manifest.json`,
which names every file with its size and checksum. The file names of both
formats live here, so the workers, the keeper and the tools agree on them:

- format 2 (now): `shard_NNNNN.bin` per rank and `tensors.json` (sharded.py),
  `trainer.pt` (sampler, schedule, scaler, extra state, RNG), crc32c per file;
- format 1 (torchrevive 0.1, still read): `model.pt`, `optimizer.pt` and
  `trainer.pt` written by rank 0, sha256 per file.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elastic._shared.common.errors import CorruptCheckpoint
from elastic._shared.common.version import __version__
from elastic._shared.storage import validate

FORMAT_VERSION = 2
"""Format of the checkpoints written now (sharded, crc32c); format 1 (rank 0's files, sha256) still loads."""
READABLE_FORMATS = (1, 2)
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 16 * 2**20
"""The largest manifest read: it names one file per rank (about 100 bytes each), so this is room
for over 100,000 ranks, and bounds what a crafted one costs."""
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
TRAINER_FILE = "trainer.pt"
TENSORS_FILE = "tensors.json"
"""Format 2: every tensor's global shape and chunks, and where each chunk lies (sharded.py writes it)."""
SHARD_PREFIX = "shard_"


def shard_file(rank: int) -> str:
    """Format 2: the file of rank `rank`'s chunks."""
    return f"{SHARD_PREFIX}{rank:05d}.bin"


MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
"""Format 1 only: model and optimizer state dicts, written by rank 0 (format 2 shards them)."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


@dataclass(frozen=True)
class Manifest:
    """What a committed checkpoint holds; stored as manifest.json beside the files."""

    step: int
    epoch: int
    consumed: int
    world_size: int
    files: dict[str, dict[str, Any]]
    """file name -> {"bytes": size, and "crc32c": int (format 2) or "sha256": hex digest (format 1)};
    format 2's shard files have a size only: their chunks' checksums are in tensors.json."""
    created: float
    reason: str
    run_id: str
    versions: dict[str, str]
    format: int = FORMAT_VERSION
    """1: rank 0's model.pt/optimizer.pt/trainer.pt with sha256s; 2: sharded tensors (sharded.py) with crc32c."""
    parts: str = ""
    """In a bucket: the folder of the save attempt whose files this is (object_store/bucket.py);
    "" in a directory, whose files lie beside the manifest (and then it is not written)."""

    def to_json(self) -> str:
        fields = {k: v for k, v in self.__dict__.items() if k != "parts" or v}
        return json.dumps(fields, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """The manifest in `text`, checked; `CorruptCheckpoint` naming what is wrong if it is not one.

        Every file it names is a bare name (`validate.BARE_NAME`), so it lies in the
        checkpoint's own directory, with a size and at most a crc32c and a sha256."""
        raw = validate.parse_json(text, MANIFEST, MAX_MANIFEST_BYTES)
        fmt = raw.get("format")
        if type(fmt) is not int or fmt not in READABLE_FORMATS:
            raise CorruptCheckpoint(f"{MANIFEST} has format {fmt!r}, this runtime reads {READABLE_FORMATS}")

        def need(key: str) -> Any:
            return validate.need_key(raw, key, MANIFEST)

        files = validate.need_dict(need("files"), f"{MANIFEST}'s files")
        stamped = validate.need_dict(need("versions"), f"{MANIFEST}'s versions")
        return cls(
            step=validate.need_int(need("step"), f"{MANIFEST}'s step"),
            epoch=validate.need_int(need("epoch"), f"{MANIFEST}'s epoch"),
            consumed=validate.need_int(need("consumed"), f"{MANIFEST}'s consumed"),
            world_size=validate.need_int(need("world_size"), f"{MANIFEST}'s world_size", lo=1),
            files={validate.need_name(name, f"{MANIFEST} file"): _file_entry(name, entry) for name, entry in files.items()},
            created=validate.need_float(need("created"), f"{MANIFEST}'s created"),
            reason=validate.need_str(need("reason"), f"{MANIFEST}'s reason", max_len=256),
            run_id=validate.need_str(need("run_id"), f"{MANIFEST}'s run_id", max_len=1024),
            versions={
                validate.need_str(k, f"{MANIFEST} version name", max_len=64):
                    validate.need_str(v, f"{MANIFEST} version of {k[:64]!r}", max_len=256)
                for k, v in stamped.items()
            },
            format=fmt,
            parts=validate.need_str(raw.get("parts", ""), f"{MANIFEST}'s parts", max_len=64),
        )

    @property
    def total_bytes(self) -> int:
        return sum(int(f["bytes"]) for f in self.files.values())


def _file_entry(name: str, raw: Any) -> dict[str, Any]:
    """One file's record: its size, and its crc32c (format 2) or sha256 (format 1) if it has one."""
    what = f"{MANIFEST}'s entry for {name}"
    raw = validate.need_dict(raw, what)
    entry: dict[str, Any] = {"bytes": validate.need_int(validate.need_key(raw, "bytes", what), f"{what}: bytes")}
    if "crc32c" in raw:
        entry["crc32c"] = validate.need_int(raw["crc32c"], f"{what}: crc32c", hi=validate.UINT32 - 1)
    if "sha256" in raw:
        entry["sha256"] = validate.need_str(raw["sha256"], f"{what}: sha256", max_len=64, pattern=_SHA256)
    return entry


def versions() -> dict[str, str]:
    return {
        "elastic": __version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }


@dataclass(frozen=True)
class Candidate:
    """A committed checkpoint found in a directory (not yet verified)."""

    name: str
    step: int
    path: Path
