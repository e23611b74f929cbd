"""The elastic sampler in an ordinary `torch.utils.data.DataLoader`.

    loader = DataLoader(seeded_samples(dataset, seed), batch_sampler=StepBatchSampler(sampler, rank, world_size),
                        num_workers=2)

`StepBatchSampler` (or `StepSampler`, for `DataLoader(batch_size=...)`) hands
the loader this rank's share of each step to come, replaying the stream of
`elastic._worker.data.sampler.ElasticSampler` from where the sampler stands when the loader
is iterated. The sampler the training loop advances stays the one source of
truth: the loader only reads ahead on a copy, so prefetched batches of steps
that never run (a kill, a preemption) cost nothing on resume.

Invariants:
- Each index the samplers yield is a `SampleKey`: an `int` (any data set
  takes it as its index) that also carries the epoch of its position in the
  stream. A global batch may straddle two epochs.
- `seeded_samples` makes the randomness of a sample (augmentations drawing
  from torch's, numpy's or Python's global generators) a function of
  (seed, epoch, index) only: not of the loader worker that loads it, the
  number of workers, the world size or where the job was restarted. The
  caller's random streams are left where they were.
- `SafeWorkerInit` makes a loader worker forked by a training process die
  with it (its copies of the process group's connections would otherwise keep
  the peers waiting) and ignore SIGTERM: torchrun stops a group by signalling
  each worker's process group, which holds its loader workers too, and a
  trainer whose loader died cannot finish its step and commit the preemption
  checkpoint.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import os
import random
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, Dataset, Sampler

from elastic._shared.common.errors import ElasticError, UsageError
from elastic._worker.data.sampler import ElasticSampler

_SAMPLE_SEED_MASK = 2**63 - 1


class SampleKey(int):
    """A sample index that knows the epoch of its position in the stream."""

    epoch: int

    def __new__(cls, index: int, epoch: int) -> SampleKey:
        key = super().__new__(cls, index)
        key.epoch = epoch
        return key

    def __reduce__(self) -> tuple[Any, ...]:  # to loader workers and back
        return SampleKey, (int(self), self.epoch)

    def __repr__(self) -> str:
        return f"SampleKey({int(self)}, epoch={self.epoch})"


class StepBatchSampler(Sampler[list[SampleKey]]):
    """A batch sampler: this rank's keys of each step to come (`steps` of them, or without end).

    Iterating starts a replay of the sampler's stream from its current
    position, on a copy; the sampler itself is never advanced here. What was
    handed out is remembered in `issued` (one list per step, oldest first)
    until the training loop takes it back with `take_issued`, which lets the
    loop check that the batch it trains on is the sampler's.
    """

    def __init__(self, sampler: ElasticSampler, rank: int, world_size: int, *, steps: int | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.sampler = sampler
        self.rank, self.world_size, self.steps = rank, world_size, steps
        self.batch_size = sampler.batch_size
        self.issued: collections.deque[list[int]] = collections.deque()

    def __len__(self) -> int:
        if self.steps is None:
            raise TypeError("a StepBatchSampler without `steps` has no length: it runs until the loop stops")
        return self.steps

    def __iter__(self) -> Iterator[list[SampleKey]]:
        replay = ElasticSampler(self.sampler.num_samples, batch_size=self.batch_size, seed=self.sampler.seed)
        replay.load_state_dict(self.sampler.state_dict())
        self.issued.clear()  # a new pass over the loader starts from the sampler's position
        # This rank's share as it stands: the loop opens the loader again when the shares change.
        (start, count), num_samples = self.sampler.share(self.rank, self.world_size), self.sampler.num_samples
        produced = 0
        while self.steps is None or produced < self.steps:
            epoch, consumed = replay.state.epoch, replay.state.consumed
            # Sliced from the global batch, not local_batch(): that call means "the loop trains on
            # this now" to whoever observes it (the chaos suite's sample audit).
            indices = replay.global_batch(self.world_size)[start : start + count].tolist()
            self.issued.append(indices)
            yield [
                SampleKey(index, epoch + (consumed + start + offset) // num_samples)
                for offset, index in enumerate(indices)
            ]
            replay.advance(self.world_size)
            produced += 1

    def take_issued(self) -> list[int] | None:
        """The oldest step handed out and not yet taken back (None: none left)."""
        return self.issued.popleft() if self.issued else None


class StepSampler(Sampler[SampleKey]):
    """The same stream as `StepBatchSampler`, one key at a time, for `DataLoader(batch_size=B)`
    with B the sampler's batch size (every step is exactly B keys, so the loader's batches line up)."""

    def __init__(self, sampler: ElasticSampler, rank: int, world_size: int, *, steps: int | None = None) -> None:
        self.batches = StepBatchSampler(sampler, rank, world_size, steps=steps)
        self.batch_size = sampler.batch_size

    def __len__(self) -> int:
        return len(self.batches) * self.batch_size

    def __iter__(self) -> Iterator[SampleKey]:
        for batch in self.batches:
            yield from batch

    def take_issued(self) -> list[int] | None:
        return self.batches.take_issued()


def step_sampler_of(loader: Any) -> StepBatchSampler | StepSampler | None:
    """The step sampler that drives `loader` (DataLoader or alike), if one does."""
    for candidate in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)):
        if isinstance(candidate, BatchSampler):
            candidate = candidate.sampler  # DataLoader(sampler=StepSampler, batch_size=B) wraps it
        if isinstance(candidate, (StepBatchSampler, StepSampler)):
            return candidate
    return None


# --- per-sample randomness ------------------------------------------------------------


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample's randomness in one epoch (a hash: no two keys collide in practice)."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SAMPLE_SEED_MASK


class SeededSamples(Dataset):
    """`dataset[key]` with torch's CPU, numpy's and Python's global generators seeded from
    `sample_seed(seed, key.epoch, key)` around it, and put back after it.

    A plain int key counts as epoch 0. CUDA generators are never touched.
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: int) -> Any:
        epoch = getattr(key, "epoch", 0)
        seed = sample_seed(self.seed, epoch, int(key))
        python_state, numpy_state = random.getstate(), np.random.get_state()
        try:
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(seed)
                random.seed(seed)
                np.random.seed(seed & 0xFFFF_FFFF)
                return self.dataset[int(key)]
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def seeded_samples(dataset: Dataset, seed: int) -> SeededSamples:
    """See `SeededSamples`."""
    return SeededSamples(dataset, seed)


# --- loader workers ---------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with(parent: int) -> None:
    """Have the kernel SIGKILL this process the moment `parent` dies (Linux; fork-started workers)."""
    if not sys.platform.startswith("linux") or os.getppid() != parent:
        return  # started by a fork server or spawn: torch's own watchdog ends it
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above took effect
        os._exit(0)


class SafeWorkerInit:
    """A DataLoader `worker_init_fn` that makes the worker safe to fork from a trainer
    (see the module docstring), then calls the user's own init function, if any."""

    def __init__(self, parent: int, then: Callable[[int], None] | None = None) -> None:
        self.parent = parent
        self.then = then

    def __call__(self, worker_id: int) -> None:
        _die_with(self.parent)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # A worker loads one sample at a time: several intra-op threads per worker
        # would only oversubscribe the cores the training process uses.
        torch.set_num_threads(1)
        if self.then is not None:
            self.then(worker_id)


def make_workers_safe(loader: Any) -> None:
    """Put `SafeWorkerInit` in front of `loader`'s worker_init_fn (idempotent; no-op without workers)."""
    if getattr(loader, "num_workers", 0) and not isinstance(loader.worker_init_fn, SafeWorkerInit):
        loader.worker_init_fn = SafeWorkerInit(os.getpid(), loader.worker_init_fn)


def open_loader(loader: Iterable[Any] | None, batch_size: int) -> tuple[Iterator[Any] | None, StepBatchSampler | StepSampler | None]:
    """Start iterating `loader` for the step loop: (its iterator, the step sampler that drives it, if any).

    Its workers are made safe first (`make_workers_safe`); a loader driven by a `StepSampler`
    must take the run's per-rank `batch_size` (one batch per step). Iterating a DataLoader draws
    its workers' base seed from torch's global generator: it is drawn from a fork of it, so a
    resumed run, iterating at another step, leaves that stream where an uninterrupted run does."""
    if loader is None:
        return None, None
    make_workers_safe(loader)
    issued = step_sampler_of(loader)
    loader_batch = getattr(loader, "batch_size", None)
    if isinstance(issued, StepSampler) and loader_batch != batch_size:
        raise UsageError(
            f"DataLoader(batch_size={loader_batch}) with run.sampler_for_loader() must take the batch size "
            f"given to run.start() ({batch_size}): each step is one batch"
        )
    with torch.random.fork_rng(devices=[]):
        return iter(loader), issued



class Feed:
    """The step loop's batches: a loader's, each checked against the sampler, or without a loader the
    sampler's own indices (the caller's `expected`).

    `reopen` starts the loader again after the group changed in place (elastic._worker.survivors.views): its step
    sampler takes the new rank and world size, and what the loader read ahead for the old ones is
    dropped with its iterator (and its workers, unless the loader keeps them: `persistent_workers`)."""

    def __init__(self, loader: Iterable[Any] | None, batch_size: int) -> None:
        self.loader, self.batch_size = loader, batch_size
        self.source, self.issued = open_loader(loader, batch_size)

    @property
    def takes_shares(self) -> bool:
        """Whether this rank's batches can change size with its share (`ElasticSampler.shares`): a
        `StepBatchSampler` reopened, or the sampler's own indices; not a DataLoader of a fixed batch size."""
        return self.loader is None or isinstance(self.issued, StepBatchSampler)

    @property
    def resizable(self) -> bool:
        """Whether `reopen` can give this rank its share at another world size."""
        return self.loader is None or self.issued is not None

    def fetch(self, expected: torch.Tensor, *, step: int, until: str) -> Any:
        return expected if self.source is None else next_batch(self.source, step=step, until=until)

    def check(self, expected: torch.Tensor, *, step: int, rank: int) -> None:
        if self.source is not None:
            check_batch(self.issued, expected, step=step, rank=rank)

    def reopen(self, rank: int, world_size: int) -> None:
        if self.loader is None or self.issued is None:
            return
        sampler = self.issued.batches if isinstance(self.issued, StepSampler) else self.issued
        sampler.rank, sampler.world_size = rank, world_size
        self.source = None  # the old iterator goes first: its workers end with it
        self.source, self.issued = open_loader(self.loader, self.batch_size)


def next_batch(source: Iterator[Any], *, step: int, until: str) -> Any:
    """The loader's batch of step `step + 1`; a loader that ran dry before the loop's end (`until`: "max_steps=N",
    "epoch E") is one clear error."""
    try:
        return next(source)
    except StopIteration:
        raise ElasticError(
            f"the data loader ended at step {step}, before {until}; drive it with run.batch_sampler(), which never runs dry"
        ) from None


def check_batch(issued: StepBatchSampler | StepSampler | None, expected: torch.Tensor, *, step: int, rank: int) -> None:
    """The loader's batch of step `step + 1` is the samples the sampler assigns this rank (`expected`)."""
    if issued is not None and issued.take_issued() != expected.tolist():
        raise ElasticError(
            f"step {step + 1}: the data loader produced other samples than the sampler assigns "
            f"to rank {rank} (was it iterated elsewhere?)"
        )
