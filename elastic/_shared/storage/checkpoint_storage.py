"""`CheckpointStorage`: what every store `--ckpt-dir` can name offers, a directory's or a bucket's.

The savers, the restore, the snapshot keeper and the tools hold a `CheckpointStorage` (`stores.open_store`
chooses the class once) and never look at the scheme again. Two classes implement it:
`directory.CheckpointStore` (a local or shared file system: a save is staged in a `.tmp.*` directory,
committed by a rename) and `object_store.bucket.BucketStore` (S3: staged under a prefix, committed by a
conditional write of the manifest). `Stage` is where a save in progress is written: a `Path` for a
directory, a `BucketStage` for a bucket. tests/unit/test_checkpoint_storage.py holds both classes to
this interface, parameter by parameter.

The order a writer follows: `prepare` (once), `claim`, then per save `check_room`, `begin`,
`write_bytes` / `write_state_file` (or the sharded writer's parts, through `part_sink`), and `finish`
(verify, then commit) or `abort`; `heartbeat` while it writes, `release` at its end. A reader:
`committed` (newest first; the `latest_pointer` consulted first), `read_checked_manifest`,
`check_sizes`, `read_file` / `load_state_file` / `tensor_metadata` (its chunks through `chunk_source`),
`verify`, and `quarantine` for a copy that failed verification. `root` names the store in messages.

Invariants both implementations keep: a checkpoint is visible to `committed` only once committed,
whole; nothing read is trusted before its manifest's size and checksum matched; nothing is ever
unpickled (`load_state_file` loads with `weights_only=True`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from elastic._shared.storage.claim import WriterIdentity
from elastic._shared.storage.location import BucketLocation
from elastic._shared.storage.manifest import Candidate, Manifest

if TYPE_CHECKING:  # chunks.py imports torch: annotations only
    from elastic._shared.storage.chunks import ChunkSource

Stage = TypeVar("Stage")


class CheckpointStorage(Protocol[Stage]):
    """See the module docstring."""

    @property
    def root(self) -> Path | BucketLocation:
        """Where the store is (`root / name` and `root.resolve()` work on both), for messages and events."""

    # -- the writer's claim on the store --------------------------------------------------------------

    def prepare(self, identity: WriterIdentity | None = None) -> None:
        """Make the store usable (create it, or check it answers); claim it for `identity` if given."""

    def writer(self) -> WriterIdentity | None:
        """The job that claimed the store, if any."""

    def claim(self, identity: WriterIdentity) -> None:
        """Record `identity` as the store's writer (refused when another live job holds it)."""

    def heartbeat(self, identity: WriterIdentity) -> None:
        """Renew `identity`'s claim."""

    def release(self, identity: WriterIdentity) -> None:
        """Give the claim up (a clean end)."""

    def check_owner(self, identity: WriterIdentity) -> None:
        """Raise when `identity` no longer holds the claim (another job took the store over)."""

    # -- a save ---------------------------------------------------------------------------------------

    def check_room(self, needed_bytes: int) -> None:
        """Raise `CheckpointStorageError` when a save of `needed_bytes` cannot fit."""

    def begin(self, step: int, tag: str) -> Stage:
        """Where the save of `step` is written until it is committed."""

    def part_sink(self, stage: Stage) -> Callable[[str], Any] | None:
        """How the sharded writer opens a rank's shard file in `stage` (None: a local file in it)."""

    def write_bytes(self, stage: Stage, file_name: str, data: bytes) -> dict[str, Any]:
        """Write `data` as `file_name` of the save; its manifest entry (size, checksum)."""

    def write_state_file(self, stage: Stage, file_name: str, obj: Any) -> dict[str, Any]:
        """Write `obj` (tensors and plain data) with torch.save as `file_name`; its manifest entry."""

    def finish(self, stage: Stage, manifest: Manifest, *, owner: WriterIdentity | None = None,
               before_commit: Callable[[], None] = ...) -> Any:
        """Verify what was written against `manifest`, then commit it atomically; where it lies now."""

    def abort(self, stage: Stage) -> None:
        """Throw a save in progress away (nothing of it is ever read)."""

    # -- what was committed ---------------------------------------------------------------------------

    def committed(self) -> list[Candidate]:
        """The committed checkpoints, newest first."""

    def latest_pointer(self) -> str | None:
        """The name the `latest` pointer holds, if any (read first, checked like any other)."""

    def read_manifest(self, candidate: Candidate) -> Manifest:
        """`candidate`'s manifest, parsed and checked field by field."""

    def read_checked_manifest(self, candidate: Candidate) -> Manifest:
        """`read_manifest`, refusing a manifest of another step or format than `candidate` names."""

    def read_file(self, candidate: Candidate, file_name: str, expected: Mapping[str, Any], *, keep: bool = True) -> bytes:
        """`file_name`'s bytes, refused unless their size and checksum are `expected`'s."""

    def check_sizes(self, candidate: Candidate, manifest: Manifest) -> None:
        """Raise when a file is missing or not the size `manifest` names (cheap, before any read)."""

    def load_state_file(self, candidate: Candidate, manifest: Manifest, file_name: str, map_location: Any = "cpu") -> Any:
        """`file_name` checked, then loaded with `weights_only=True`."""

    def tensor_metadata(self, candidate: Candidate, manifest: Manifest) -> Any:
        """The sharded format's tensor metadata (what a resharding restore plans with)."""

    def chunk_source(self, path: Any) -> ChunkSource | None:
        """Where a restore reads the chunks of the checkpoint at `path` (None: its local files)."""

    def verify(self, candidate: Candidate) -> Manifest:
        """Check every file of `candidate` against its manifest; the manifest."""

    def quarantine(self, candidate: Candidate) -> Any:
        """Move a copy that failed verification aside (never deleted, never read again); where it went."""
