"""Reading a bucket prefix's committed checkpoints, checked: listing, manifests, files, chunks, verification.

`BucketReader` is the reading half of a bucket's store (bucket.py's `BucketStore`, which adds the claim,
the commit, retention and the quarantine, extends it); the layout and the commit protocol are
bucket.py's docstring.

Invariants:
- A checkpoint is listed only when its manifest object (`step_N/manifest.json`) exists: a torn upload
  is never seen. `latest` is only a hint.
- Everything read from the bucket is untrusted: a manifest at most `MAX_MANIFEST_BYTES`, parsed by
  `Manifest.from_json`; its attempt a plain name (`ATTEMPT`); every file a bare name within the
  attempt folder; sizes checked before a byte is read, and nothing read past them.
- A manifest is read once per process and cached (a commit never changes: only a quarantine, which
  drops it from the cache, removes it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

import crc32c

from elastic._shared.common.errors import CorruptCheckpoint
from elastic._shared.storage import validate
from elastic._shared.storage.directory_reader import load_checked_state
from elastic._shared.storage.location import BucketLocation
from elastic._shared.storage.manifest import MANIFEST, MAX_MANIFEST_BYTES, TENSORS_FILE, Candidate, Manifest
from elastic._shared.storage.object_store.objects import ObjectMissing, Objects, ObjectTooLarge
from elastic._shared.storage.object_store.transfer import PIECE, BucketChunks

LATEST = "latest"
STEP = re.compile(r"^step_(\d{8})$")
"""A committed checkpoint's folder name."""
ATTEMPT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
"""A save attempt's folder name (a saver's tag, a keeper's own)."""


class BucketReader:
    """The committed checkpoints under the prefix `root`, each read only after it checks."""

    def __init__(self, location: BucketLocation, objects: Objects) -> None:
        self.root = location
        self.objects = objects
        self._manifests: dict[str, tuple[str, Manifest]] = {}
        """Checkpoint name -> (its manifest's raw text, the manifest) as last read."""

    def committed(self) -> list[Candidate]:
        """Committed checkpoints (those with a manifest object), newest step first."""
        prefix = self.root.key() + "/" if self.root.prefix else ""
        found: dict[int, Candidate] = {}
        for info in self.objects.list(prefix):
            parts = info.key[len(prefix):].split("/")
            if len(parts) == 2 and parts[1] == MANIFEST and STEP.match(parts[0]):
                step = int(parts[0][5:])
                found[step] = Candidate(parts[0], step, PurePosixPath(self.root.key(parts[0])))  # type: ignore[arg-type]
        return sorted(found.values(), key=lambda c: c.step, reverse=True)

    def latest_pointer(self) -> str | None:
        try:
            raw, _ = self.objects.get(self.root.key(LATEST), limit=256)
        except (ObjectMissing, ObjectTooLarge):
            return None
        return raw.decode("utf-8", errors="replace").strip() or None

    def _manifest_of(self, candidate: Candidate) -> Manifest:
        """The manifest of `candidate`, read once per process (a commit never changes: only a quarantine
        removes it)."""
        cached = self._manifests.get(candidate.name)
        if cached is not None:
            return cached[1]
        return self.read_manifest(candidate)

    def read_manifest(self, candidate: Candidate) -> Manifest:
        try:
            raw, _ = self.objects.get(self.root.key(candidate.name, MANIFEST), limit=MAX_MANIFEST_BYTES)
        except ObjectMissing:
            raise CorruptCheckpoint(f"{candidate.name} has no {MANIFEST}") from None
        except ObjectTooLarge:
            raise CorruptCheckpoint(f"{candidate.name}/{MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes") from None
        try:
            manifest = Manifest.from_json(raw)
        except CorruptCheckpoint as exc:
            raise CorruptCheckpoint(f"{candidate.name}: {exc}") from None
        if not ATTEMPT.match(manifest.parts):
            raise CorruptCheckpoint(f"{candidate.name}/{MANIFEST} names no upload folder ({manifest.parts[:80]!r})")
        self._manifests[candidate.name] = (raw.decode("utf-8", errors="replace"), manifest)
        if len(self._manifests) > 4096:
            self._manifests.clear()
        return manifest

    def read_checked_manifest(self, candidate: Candidate) -> Manifest:
        manifest = self.read_manifest(candidate)
        if manifest.step != candidate.step:
            raise CorruptCheckpoint(f"{candidate.name}/{MANIFEST} says step {manifest.step}")
        return manifest

    def _file_key(self, candidate: Candidate, file_name: str) -> str:
        manifest = self._manifest_of(candidate)
        return self.root.key(candidate.name, manifest.parts, validate.need_name(file_name, f"{candidate.name} file"))

    def read_file(self, candidate: Candidate, file_name: str, expected: Mapping[str, Any], *, keep: bool = True) -> bytes:
        """The file's bytes (empty unless `keep`), after checking its size and checksum; read in ranges,
        never past the size the manifest gives."""
        key, size = self._file_key(candidate, file_name), int(expected["bytes"])
        where = f"{candidate.name}/{file_name}"
        kept = bytearray(size) if keep else bytearray()
        crc, got = 0, 0
        try:
            for lo in range(0, size, PIECE):
                data = self.objects.get_range(key, lo, min(lo + PIECE, size))
                if keep:
                    kept[lo : lo + len(data)] = data
                crc = crc32c.crc32c(data, crc)
                got += len(data)
                if len(data) < min(PIECE, size - lo):
                    break
            if size == 0:
                self.objects.head(key)
        except ObjectMissing:
            raise CorruptCheckpoint(f"{where} is missing") from None
        if got != size:
            raise CorruptCheckpoint(f"{where} has {got} bytes, the manifest says {size}")
        if "crc32c" in expected and crc != int(expected["crc32c"]):
            raise CorruptCheckpoint(f"{where} fails its crc32c check")
        if "sha256" in expected:  # format 1 (only ever in a directory): never trusted unchecked
            raise CorruptCheckpoint(f"{where} has a sha256 (format 1), which a bucket does not hold")
        return bytes(kept)

    def check_sizes(self, candidate: Candidate, manifest: Manifest) -> None:
        """Every file the manifest names is there with its size (one listing of its folder)."""
        folder = self.root.key(candidate.name, manifest.parts) + "/"
        sizes = {o.key[len(folder):]: o.size for o in self.objects.list(folder)}
        for file_name, expected in manifest.files.items():
            if file_name not in sizes:
                raise CorruptCheckpoint(f"{candidate.name}/{file_name} is missing")
            if sizes[file_name] != int(expected["bytes"]):
                raise CorruptCheckpoint(
                    f"{candidate.name}/{file_name} has {sizes[file_name]} bytes, the manifest says {expected['bytes']}"
                )

    def load_state_file(self, candidate: Candidate, manifest: Manifest, file_name: str, map_location: Any = "cpu") -> Any:
        if file_name not in manifest.files:
            raise CorruptCheckpoint(f"{candidate.name} holds no {file_name}")
        data = self.read_file(candidate, file_name, manifest.files[file_name])
        return load_checked_state(data, f"{candidate.name}/{file_name}", map_location)

    def tensor_metadata(self, candidate: Candidate, manifest: Manifest) -> Any:
        from elastic._shared.storage import tensors_json  # DCP's metadata: about 1 s of import

        if TENSORS_FILE not in manifest.files:
            raise CorruptCheckpoint(f"{candidate.name} holds no {TENSORS_FILE}")
        text = self.read_file(candidate, TENSORS_FILE, manifest.files[TENSORS_FILE])
        return tensors_json.metadata_from_json(text, {name: entry["bytes"] for name, entry in manifest.files.items()})

    def verify(self, candidate: Candidate) -> Manifest:
        """Read and check every byte of a checkpoint (one process); `CorruptCheckpoint` if any fails."""
        from elastic._shared.storage.chunks import read_rows

        manifest = self.read_checked_manifest(candidate)
        self.check_sizes(candidate, manifest)
        for file_name, expected in manifest.files.items():
            if "sha256" in expected or "crc32c" in expected:
                self.read_file(candidate, file_name, expected, keep=False)
        if manifest.format >= 2:
            metadata = self.tensor_metadata(candidate, manifest)
            source = self.chunk_source(candidate.path)
            try:
                items = sorted(metadata.storage_data.items(), key=lambda kv: (kv[1].file, kv[1].offset))
                source.expect([(s.file, s.offset, s.offset + s.length) for _, s in items])
                for index, stored in items:
                    read_rows(PurePosixPath(candidate.name), stored, index.fqn, None, source=source)  # type: ignore[arg-type]
            finally:
                source.close()
        return manifest

    def chunk_source(self, path: Any) -> BucketChunks:
        """Where a restore reads the chunks of the checkpoint at `path` (a committed step's folder)."""
        name = PurePosixPath(str(path)).name
        step = _step_of(name)
        manifest = self._manifest_of(Candidate(name, step, PurePosixPath(str(path))))  # type: ignore[arg-type]
        folder = self.root.key(name, manifest.parts)
        return BucketChunks(self.objects, lambda file: f"{folder}/{validate.need_name(file, 'a shard file')}")


def _step_of(name: str) -> int:
    if not STEP.match(name):
        raise CorruptCheckpoint(f"{name[:80]!r} is not a checkpoint's name")
    return int(name[5:])
