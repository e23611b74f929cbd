"""Reading a checkpoint directory's committed checkpoints, checked: listing, manifests, files, verification.

`DirectoryReader` is the reading half of a directory's store (directory.py's `CheckpointStore`, which
adds the claim, the commit and the quarantine, extends it); the layout is directory.py's docstring.

Invariants:
- Only `step_XXXXXXXX` directories are listed (and a `step_N.replaced` whose replace died halfway,
  when no `step_N` is there); a `.tmp.*` directory is never read.
- `latest` is read before the directory is listed, and the checkpoint it names counts even when the
  listing misses it (an NFS client's stale directory cache); it is not trusted otherwise.
- A manifest, tensors.json and `latest` are untrusted input (validate.py): a file they name is a bare
  name in the checkpoint's directory and a regular file, its size is checked by stat before it is
  read, and nothing is read or allocated past it; anything else is a `CorruptCheckpoint`.
- Nothing loads pickled code: tensors are raw bytes (format 2), other state files load with
  `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import crc32c
import torch

from elastic._shared.common.errors import CorruptCheckpoint
from elastic._shared.common.errors import first_line as _first_line
from elastic._shared.storage import validate
from elastic._shared.storage.manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    TENSORS_FILE,
    Candidate,
    Manifest,
    checkpoint_name,
)

LATEST = "latest"
COMMITTED = re.compile(r"^step_(\d{8})$")
"""A committed checkpoint's directory name."""
REPLACED = re.compile(r"^step_(\d{8})\.replaced$")
"""The old copy of a step a commit is replacing (directory.py's `_publish`)."""
_READ_CHUNK = 8 * 2**20


class DirectoryReader:
    """The committed checkpoints of the directory `root`, each read only after it checks."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.root = Path(directory)

    def part_sink(self, tmp: Path) -> None:
        """None: a rank's shard is written to a local file in `tmp` (a bucket streams it up instead)."""
        return None

    def chunk_source(self, path: Any) -> None:
        """None: a restore reads the chunks from the checkpoint's own files (a bucket reads ranges)."""
        return None

    def committed(self) -> list[Candidate]:
        """Committed checkpoints, newest step first.

        `latest` is read before the directory is listed, and the checkpoint it
        names counts even when the listing misses it (a stale NFS directory cache).
        """
        if not self.root.is_dir():
            return []
        found: dict[int, Candidate] = {}
        pointed = self.latest_pointer()
        if pointed is not None and COMMITTED.match(pointed) and (self.root / pointed).is_dir():
            found[int(pointed[5:])] = Candidate(pointed, int(pointed[5:]), self.root / pointed)
        replaced: dict[int, Candidate] = {}
        for entry in self.root.iterdir():
            match = COMMITTED.match(entry.name)
            if match and entry.is_dir():
                found[int(match.group(1))] = Candidate(entry.name, int(match.group(1)), entry)
            elif (match := REPLACED.match(entry.name)) and entry.is_dir():
                step = int(match.group(1))
                replaced[step] = Candidate(checkpoint_name(step), step, entry)
        for step, candidate in replaced.items():
            found.setdefault(step, candidate)  # a replace that died halfway: the old copy counts
        return sorted(found.values(), key=lambda c: c.step, reverse=True)

    def latest_pointer(self) -> str | None:
        """The name `latest` holds (None: no such file, or not a small regular file; it is only a hint)."""
        try:
            raw = validate.read_bounded(self.root / LATEST, LATEST, 256)
        except (FileNotFoundError, NotADirectoryError, CorruptCheckpoint):
            return None
        return raw.decode("utf-8", errors="replace").strip() or None

    def read_manifest(self, candidate: Candidate) -> Manifest:
        try:
            return Manifest.from_json(validate.read_bounded(candidate.path / MANIFEST, MANIFEST, MAX_MANIFEST_BYTES))
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{candidate.name} has no {MANIFEST}") from None
        except CorruptCheckpoint as exc:
            raise CorruptCheckpoint(f"{candidate.name}: {exc}") from None

    def read_checked_manifest(self, candidate: Candidate) -> Manifest:
        """The manifest, checked to name the candidate's step (`CorruptCheckpoint` if not)."""
        manifest = self.read_manifest(candidate)
        if manifest.step != candidate.step:
            raise CorruptCheckpoint(f"{candidate.name}/{MANIFEST} says step {manifest.step}")
        return manifest

    def read_file(self, candidate: Candidate, file_name: str, expected: Mapping[str, Any], *, keep: bool = True) -> bytes:
        """The file's bytes (empty unless `keep`), after checking its size and checksum.

        Format 2 files carry a crc32c, format 1 files a sha256; shard files carry
        only a size (their chunks are checked as they are read). A file not kept
        is checked in chunks, so checking a large one costs no memory.
        """
        digest = hashlib.sha256() if "sha256" in expected else None
        crc, size, data = 0, 0, b""
        where = f"{candidate.name}/{file_name}"
        try:
            with validate.open_regular(candidate.path / validate.need_name(file_name, where), where) as f:
                # Stat before reading: a declared size is never an allocation, nor a read past the file.
                if validate.file_size(f) != int(expected["bytes"]):
                    raise CorruptCheckpoint(
                        f"{where} has {validate.file_size(f)} bytes, the manifest says {expected['bytes']}"
                    )
                limit = int(expected["bytes"]) + 1  # one more: a file grown meanwhile is found
                if keep:
                    data = f.read(limit)
                    chunks = [data]
                else:
                    chunks = iter(lambda: f.read(_READ_CHUNK), b"")
                for chunk in chunks:
                    size += len(chunk)
                    if size > limit:
                        break
                    if digest is not None:
                        digest.update(chunk)
                    elif "crc32c" in expected:
                        crc = crc32c.crc32c(chunk, crc)
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{candidate.name}/{file_name} is missing") from None
        if size != int(expected["bytes"]):
            raise CorruptCheckpoint(f"{candidate.name}/{file_name} has {size} bytes, the manifest says {expected['bytes']}")
        if digest is not None and digest.hexdigest() != expected["sha256"]:
            raise CorruptCheckpoint(f"{candidate.name}/{file_name} fails its sha256 check")
        if "crc32c" in expected and crc != int(expected["crc32c"]):
            raise CorruptCheckpoint(f"{candidate.name}/{file_name} fails its crc32c check")
        return data

    def check_sizes(self, candidate: Candidate, manifest: Manifest) -> None:
        """Every file the manifest names exists with its size (cheap: a stat each)."""
        for file_name, expected in manifest.files.items():
            try:
                size = validate.regular_size(candidate.path / file_name, f"{candidate.name}/{file_name}")
            except FileNotFoundError:
                raise CorruptCheckpoint(f"{candidate.name}/{file_name} is missing") from None
            if size != int(expected["bytes"]):
                raise CorruptCheckpoint(
                    f"{candidate.name}/{file_name} has {size} bytes, the manifest says {expected['bytes']}"
                )

    def load_state_file(self, candidate: Candidate, manifest: Manifest, file_name: str, map_location: Any = "cpu") -> Any:
        """One checked state file, deserialised with weights_only=True (`CorruptCheckpoint` if it fails)."""
        if file_name not in manifest.files:
            raise CorruptCheckpoint(f"{candidate.name} holds no {file_name}")
        data = self.read_file(candidate, file_name, manifest.files[file_name])
        return load_checked_state(data, f"{candidate.name}/{file_name}", map_location)

    def verify(self, candidate: Candidate) -> Manifest:
        """Read and check every byte of a checkpoint (one process); `CorruptCheckpoint` if any fails."""
        manifest = self.read_checked_manifest(candidate)
        self.check_sizes(candidate, manifest)
        for file_name, expected in manifest.files.items():
            if "sha256" in expected or "crc32c" in expected:
                self.read_file(candidate, file_name, expected, keep=False)
        if manifest.format >= 2:
            from elastic._shared.storage import (
                sharded,  # DCP, about 1 s of import: the agent's keeper rarely verifies
            )

            sharded.verify_tensors(candidate.path, self.tensor_metadata(candidate, manifest))
        return manifest

    def tensor_metadata(self, candidate: Candidate, manifest: Manifest) -> Any:
        """A format-2 checkpoint's DCP metadata (checked against its crc32c)."""
        from elastic._shared.storage import tensors_json  # DCP's metadata: about 1 s of import

        if TENSORS_FILE not in manifest.files:
            raise CorruptCheckpoint(f"{candidate.name} holds no {TENSORS_FILE}")
        text = self.read_file(candidate, TENSORS_FILE, manifest.files[TENSORS_FILE])
        # Chunks must lie within the files as the manifest sizes them (checked by stat).
        return tensors_json.metadata_from_json(text, {name: entry["bytes"] for name, entry in manifest.files.items()})


def load_checked_state(data: bytes, where: str, map_location: Any = "cpu") -> Any:
    """A state file's bytes, already checked against its manifest, deserialised with weights_only=True
    (never unpickled beyond tensors and plain containers); `CorruptCheckpoint` (one line) if they do not
    load. Both stores' `load_state_file` end here."""
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a file that checks right but was written wrong
        raise CorruptCheckpoint(f"{where} does not deserialize: {_first_line(exc)}") from None
