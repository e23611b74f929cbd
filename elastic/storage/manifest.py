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
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elastic.version import __version__

FORMAT_VERSION = 2
"""Format of the checkpoints written now (sharded, crc32c); format 1 (rank 0's files, sha256) still loads."""
READABLE_FORMATS = (1, 2)
MANIFEST = "manifest.json"
TRAINER_FILE = "trainer.pt"
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

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        raw = json.loads(text)
        if raw.get("format") not in READABLE_FORMATS:
            raise ValueError(f"manifest format {raw.get('format')!r}, this runtime reads {READABLE_FORMATS}")
        return cls(
            step=int(raw["step"]), epoch=int(raw["epoch"]), consumed=int(raw["consumed"]),
            world_size=int(raw["world_size"]), files=dict(raw["files"]), created=float(raw["created"]),
            reason=str(raw["reason"]), run_id=str(raw["run_id"]), versions=dict(raw["versions"]),
            format=int(raw["format"]),
        )

    @property
    def total_bytes(self) -> int:
        return sum(int(f["bytes"]) for f in self.files.values())


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
