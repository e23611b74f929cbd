"""The restore: pick the newest step every rank can restore, read it, and say where it came from.

    restored = RestorePlanner(...).restore(claim)   # every rank; None: nothing to restore

Order of the sources: the in-memory snapshots first (when every node runs a
keeper), then the checkpoints on disk. Rank 0 takes each source's offers in
turn (sources.py) and tells every rank which one to restore (a `Decision`);
every rank opens it, all agree they could, and the loader reads it.

Invariants:
- Every rank takes the same path through the collectives: each decision
  comes from rank 0, and whether every rank could open an offer is agreed on
  before anyone reads.
- An offer that fails verification goes to the next offer; a source whose
  storage fails (a peer that stops answering) falls to the next source where
  it may (`storage_errors_fall_back`); a restore that runs past its deadline
  stops the job (`RestoreTimedOut`).
- A storage error at any step (claiming, listing, verifying on rank 0;
  reading on any rank) is one `CheckpointStorageError` line raised on every
  rank together (exit 75): rank 0's through its `_Start` or `Decision`, a
  read's through the loader's agreement; never an OSError on one rank while
  the others wait.
- Nothing live changes until an offer is read and verified on every rank (loader.py).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from elastic._shared.common.errors import (
    CheckpointError,
    CheckpointStorageError,
    CorruptCheckpoint,
    RestoreTimedOut,
)
from elastic._shared.storage.checkpoint_storage import CheckpointStorage
from elastic._shared.storage.durable import describe_failure
from elastic._shared.storage.manifest import Candidate
from elastic._worker.checkpoint.directory_claim import DirectoryClaim
from elastic._worker.checkpoint.disk_source import DiskSource
from elastic._worker.checkpoint.loader import Loader
from elastic._worker.checkpoint.memory import MemorySnapshots
from elastic._worker.checkpoint.memory_source import MemorySource
from elastic._worker.checkpoint.sources import (
    DISK,
    Decision,
    Failure,
    Offer,
    Opened,
    RestoreSource,
    share_rngs,
    without_rngs,
)
from elastic._worker.checkpoint.training_state import TrainingState
from elastic._worker.control import agreement
from elastic._worker.runtime.context import WorkerContext, barrier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Start(agreement.Message):
    """Rank 0's first word at restore: a tag naming this restore (temporaries, the snapshots'
    generation), or why the job must stop before anything is read."""

    tag: str
    failure: Failure | None

    def to_plain(self) -> dict:
        return {"tag": self.tag, "failure": self.failure.to_plain() if self.failure is not None else None}

    @classmethod
    def from_plain(cls, raw: object) -> _Start:
        if not isinstance(raw, dict) or set(raw) != {"tag", "failure"}:
            raise ValueError("a restore start from rank 0 has the wrong fields")
        return cls(str(raw["tag"]), Failure.from_plain(raw["failure"]) if raw["failure"] is not None else None)


@dataclass(frozen=True)
class Restored:
    """What a restore loaded, on this rank."""

    offer: Offer
    started: float
    """time.perf_counter() when the restore began."""
    bytes_read: int
    bytes_fetched: int


class RestorePlanner:
    """One restore of one rank's training state (see the module docstring)."""

    def __init__(
        self, ctx: WorkerContext, state: TrainingState, store: CheckpointStorage[Any], loader: Loader,
        memory: MemorySnapshots | None, *, restore_timeout: float,
    ) -> None:
        self._ctx = ctx
        self.state = state
        self.store = store
        self.loader = loader
        self.memory = memory
        self._restore_timeout = restore_timeout
        self.tag = ""
        """Shared by every rank once `restore` ran: names the temporary directory of each save."""

    def restore(self, claim: DirectoryClaim | None) -> Restored | None:
        """Load the newest step every rank can restore (a collective); None when there is none."""
        ctx = self._ctx
        started = time.perf_counter()
        deadline = time.monotonic() + self._restore_timeout
        candidates: list[Candidate] = []
        start = _Start(uuid.uuid4().hex[:8], None)
        if ctx.is_main:
            assert claim is not None
            try:
                claim.prepare()  # a storage that refuses writes stops a restart here, before any training
                candidates = self.store.committed()
            except (CheckpointError, OSError) as exc:
                start = _Start(start.tag, Failure.of(_checkpoint_error(exc, f"cannot list {self.store.root}")))
        start = agreement.from_main(ctx, start if ctx.is_main else None, _Start)
        assert start is not None
        if start.failure is not None:
            raise start.failure.error()  # every rank raises the same error
        self.tag = start.tag
        sources: list[RestoreSource] = []
        memory = self._agree_on_memory()
        if memory is not None:
            memory.generation = self.tag
            source = MemorySource(
                ctx, memory, self.state, ckpt_dir=str(self.store.root.resolve()), tag=self.tag,
                newest_on_disk=candidates[0].step if candidates else -1, deadline=deadline,
            )
            source.gather()
            sources.append(source)
        sources.append(DiskSource(self.store, self.state, candidates))
        offers = _chain(sources) if ctx.is_main else None
        while True:
            offer = self._next(offers)
            if offer is None:
                break
            source = next(s for s in sources if _serves(s, offer))
            loaded = self._load(source, offer, deadline)
            if loaded is not None:
                if ctx.is_main:
                    source.restored(offer)
                return Restored(offer, started, *loaded)
        barrier(ctx)
        logger.info("no checkpoint in %s: starting at step 0", self.store.root)
        return None

    def _agree_on_memory(self) -> MemorySnapshots | None:
        """The memory tier when every node runs a keeper; otherwise off everywhere (every rank
        takes the same path through the collectives: one node without a keeper turns it off)."""
        memory = self.memory
        if not agreement.all_ok(self._ctx, memory is not None) and memory is not None:
            if self._ctx.is_main:
                logger.warning("in-memory snapshots are off: a node of this job has no snapshot keeper")
            memory.close(timeout=0)
            self.memory = None
        return self.memory

    def _next(self, offers: Iterator[Offer] | None) -> Offer | None:
        """Rank 0's next offer, on every rank (a `CheckpointError` rank 0 met is raised on every rank)."""
        decision = Decision()
        if offers is not None:
            try:
                decision = Decision(offer=next(offers, None))
            except (CheckpointError, OSError) as exc:
                failure = _checkpoint_error(exc, f"cannot read checkpoints in {self.store.root}")
                decision = Decision(failure=Failure.of(failure))
        decision, rngs = without_rngs(decision)  # every old rank's RNG: each rank gets its own, not all
        shared = agreement.from_main(self._ctx, decision if self._ctx.is_main else None, Decision)
        assert shared is not None
        if shared.failure is not None:
            raise shared.failure.error()
        if shared.offer is not None:
            share_rngs(self._ctx, shared.offer, rngs if self._ctx.is_main else None)
        return shared.offer

    def _load(self, source: RestoreSource, offer: Offer, deadline: float) -> tuple[int, int] | None:
        """Open and read `offer` on every rank: (bytes read, bytes fetched), or None to go on to the next."""
        opened: Opened | None = None
        why = None
        try:
            opened = source.open(offer)
        except OSError as exc:
            why = f"rank {self._ctx.rank} could not get its parts: {describe_failure(exc)}"
        if not agreement.all_ok(self._ctx, opened is not None):
            if opened is not None:
                opened.cleanup()
            if self._ctx.is_main:
                source.rejected(offer, why or "another rank could not get its parts")
            return None
        assert opened is not None
        try:
            read = self.loader.load(offer, opened, deadline)
        except CorruptCheckpoint as exc:  # on every rank alike (the read is DCP's collective)
            if self._ctx.is_main:
                source.rejected(offer, str(exc))
            return None
        except CheckpointStorageError as exc:
            if isinstance(exc, RestoreTimedOut) or not source.storage_errors_fall_back:
                raise
            if self._ctx.is_main:
                source.rejected(offer, str(exc))
            return None
        finally:
            opened.cleanup()
        return read, opened.bytes_fetched()


def _checkpoint_error(exc: CheckpointError | OSError, what: str) -> CheckpointError:
    """`exc` as the error every rank raises: an OSError is the storage's (`CheckpointStorageError`)."""
    if isinstance(exc, OSError):
        return CheckpointStorageError(f"{what}: {describe_failure(exc)}")
    return exc


def _chain(sources: list[RestoreSource]) -> Iterator[Offer]:
    for source in sources:
        yield from source.offers()


def _serves(source: RestoreSource, offer: Offer) -> bool:
    """Whether `offer` is `source`'s (memory offers say "memory" or "peer")."""
    return (offer.source == DISK) == (source.kind == DISK)
