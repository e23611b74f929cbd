"""Where a restore can come from, behind one interface: what can you restore, then read it.

Two sources, tried in this order by the planner (planner.py):

- `MemorySource` (memory_source.py): the in-memory snapshots the nodes' keepers
  hold, the workers' own parts ("memory") or peers' replicas of them ("peer");
- `DiskSource` (disk_source.py): the committed checkpoints of `--ckpt-dir`.

A source offers steps (`offers`, rank 0), newest first, each already checked
to fit this run; every rank then opens the chosen one (`open`: where this
rank reads its bytes), and the loader reads and verifies them (loader.py).

Invariants:
- An `Offer` is what every rank learns of a step before reading it: it crosses
  ranks as a plain message (agreement.Message), never as a pickle. Its trainer
  state holds every old rank's RNG state (about 10 KB each): those travel apart
  (`without_rngs`, `share_rngs`: a scatter, each rank its own), so every rank
  receives O(1) of them, not all N.
- `open` changes nothing live and may fail on one rank only (an `OSError`);
  the planner then has every rank agree before anyone reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from elastic._shared.common.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointStorageError,
    RestoreTimedOut,
)
from elastic._shared.storage.chunks import ChunkSource
from elastic._shared.storage.manifest import Manifest
from elastic._worker.control import agreement

MEMORY, PEER, DISK = "memory", "peer", "disk"


@dataclass(frozen=True)
class Offer(agreement.Message):
    """A step a source can restore, checked on rank 0 to fit this run."""

    source: str
    """DISK; MEMORY (every part where its writer left it) or PEER (some only as replicas)."""
    name: str
    """What messages call it: step_NNNNNNNN, or "the in-memory snapshot of step N"."""
    checkpoint: str
    """The checkpoint the step is, or becomes once persisted: step_NNNNNNNN."""
    manifest: str
    """Manifest JSON: the checkpoint's, or one describing the snapshot."""
    trainer: dict[str, Any]
    """The trainer state (trainer.pt), every rank's RNG included."""
    tensors_json: str | None
    """tensors.json of the step's tensors; None for a format-1 checkpoint (rank 0's whole files)."""
    directory: str | None = None
    """Disk only: the checkpoint's directory (step_N, or step_N.replaced after a replace that died)."""
    locations: dict[int, list[list[str]]] | None = None
    """Memory only: old rank -> [node, keeper URL, "local" | "replica", part stem] of each copy of its part."""

    @property
    def step(self) -> int:
        return self.parsed_manifest.step

    @property
    def parsed_manifest(self) -> Manifest:
        return Manifest.from_json(self.manifest)


@dataclass
class Opened:
    """Where this rank reads an offer's bytes."""

    directory: Path
    chunks: ChunkSource | None = None
    """Where the bytes come from instead of `directory`'s files (snapshot parts); None: the files."""
    bytes_fetched: Callable[[], int] = lambda: 0
    """Bytes this rank fetched from other nodes (after the read)."""
    cleanup: Callable[[], None] = field(default=lambda: None)
    """Remove what `open` made (called once the read is over, whatever its outcome)."""


class RestoreSource(Protocol):
    kind: str
    """MEMORY or DISK."""
    storage_errors_fall_back: bool
    """Whether a storage error while reading an offer (a peer that stops answering) falls back
    to the next source, rather than stopping the job."""

    def offers(self) -> Iterator[Offer]:
        """Rank 0: the steps it can restore, newest first, each checked to fit this run.
        Raises a `CheckpointError` that every rank must raise (the planner shares it)."""
        ...

    def open(self, offer: Offer) -> Opened:
        """Every rank: where to read `offer`. `OSError` when this rank cannot get its bytes."""
        ...

    def rejected(self, offer: Offer, reason: str) -> None:
        """Rank 0: `offer` did not verify when read (one warning is said already)."""
        ...

    def restored(self, offer: Offer) -> None:
        """Rank 0: `offer` is what the job resumed from."""
        ...


_FAILURES: dict[str, type[CheckpointError]] = {
    cls.__name__: cls for cls in (CheckpointError, CheckpointStorageError, CheckpointMismatchError, RestoreTimedOut)
}


@dataclass(frozen=True)
class Failure(agreement.Message):
    """An error rank 0 met that every rank raises alike."""

    kind: str
    message: str

    @classmethod
    def of(cls, error: CheckpointError) -> Failure:
        kind = type(error).__name__ if type(error).__name__ in _FAILURES else "CheckpointError"
        return cls(kind, str(error))

    def error(self) -> CheckpointError:
        return _FAILURES.get(self.kind, CheckpointError)(self.message)


@dataclass(frozen=True)
class Decision(agreement.Message):
    """Rank 0's word to every rank: restore `offer`, stop with `failure`, or (neither) start afresh."""

    offer: Offer | None = None
    failure: Failure | None = None

    def to_plain(self) -> dict[str, Any]:
        return {
            "offer": self.offer.to_plain() if self.offer is not None else None,
            "failure": self.failure.to_plain() if self.failure is not None else None,
        }

    @classmethod
    def from_plain(cls, raw: Any) -> Decision:
        if not isinstance(raw, dict) or set(raw) != {"offer", "failure"}:
            raise ValueError("a restore decision from rank 0 has the wrong fields")
        return cls(
            Offer.from_plain(raw["offer"]) if raw["offer"] is not None else None,
            Failure.from_plain(raw["failure"]) if raw["failure"] is not None else None,
        )


@dataclass(frozen=True)
class RankRng(agreement.Message):
    """One old rank's RNG state (plain values and tensors), or None: no old rank of that number."""

    state: Any


def without_rngs(decision: Decision) -> tuple[Decision, list[Any]]:
    """`decision` with its offer's RNG states taken out (as many `None`s left in their place), and them."""
    offer = decision.offer
    if offer is None or not isinstance(offer.trainer.get("rng"), list):
        return decision, []
    rngs = offer.trainer["rng"]
    trainer = {**offer.trainer, "rng": [None] * len(rngs)}
    return Decision(offer=dataclasses.replace(offer, trainer=trainer), failure=decision.failure), rngs


def share_rngs(ctx: Any, offer: Offer, rngs: list[Any] | None, group: Any = agreement.DEFAULT_GROUP) -> None:
    """A collective after `without_rngs`: rank 0 (`rngs`) gives each rank its old rank's RNG state, put back
    in its place in `offer`'s trainer state (a rank beyond the old world gets none: it is seeded afresh)."""
    places = offer.trainer.get("rng")
    if not isinstance(places, list):
        return
    given = None if rngs is None else [RankRng(rngs[r] if r < len(rngs) else None) for r in range(ctx.world_size)]
    mine = agreement.scatter_from_main(ctx, given, RankRng, group)
    if mine is not None and mine.state is not None and ctx.rank < len(places):
        places[ctx.rank] = mine.state
