"""Elastic sampler: which samples each rank trains on, exactly once per epoch.

The job reads one stream of sample indices: the permutation of epoch 0, then
of epoch 1, and so on; the permutation of an epoch is a function of
(seed, epoch) only. Each step the whole job takes the next
`batch_size * world_size` indices of the stream and rank r takes the r-th
block of `batch_size` of them.

Invariants:
- The sampler's state is two integers: the epoch, and how many samples of that
  epoch the whole job has consumed. It does not depend on the world size, so a
  job restarted at another world size continues where it stopped and every
  sample of an epoch is used exactly once: no skip, no duplicate.
- The last partial batch of an epoch is not dropped and not padded: a global
  batch that crosses the end of an epoch is completed with the first samples
  of the next epoch's permutation. Every batch is full and every rank gets
  exactly `batch_size` samples, at any world size.
- Shares (`--slow-ranks rebalance`): the global batch may be split unevenly,
  rank r taking the r-th block of `shares[r]` samples (each at least 1, their sum
  `batch_size * world_size`): the global batch, and so the stream, stay the same,
  only the cut between ranks moves. Shares hold at the world size they were set
  for; at any other, the split is even again. They are part of the state (only
  when set: a state without them is exactly as before).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# Epoch permutations are seeded with seed * _EPOCH_STRIDE + epoch: distinct
# (seed, epoch) pairs get distinct generators for any realistic epoch count.
_EPOCH_STRIDE = 1_000_003


@dataclass(frozen=True)
class SamplerState:
    """Position in the stream: plain ints, so it checkpoints without pickling."""

    epoch: int = 0
    consumed: int = 0
    """Samples of `epoch` consumed by the whole job, 0 <= consumed < num_samples."""


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of an epoch: a function of (num_samples, seed, epoch) only."""
    generator = torch.Generator().manual_seed(seed * _EPOCH_STRIDE + epoch)
    return torch.randperm(num_samples, generator=generator)


class ElasticSampler:
    """Hands each rank its share of the next global batch of the epoch stream."""

    def __init__(self, num_samples: int, *, batch_size: int, seed: int = 0) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples} must be at least 1")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self._state = SamplerState()
        self._perm_cache: dict[int, torch.Tensor] = {}
        self.shares: tuple[int, ...] | None = None
        """Each rank's samples of a global batch (None: `batch_size` each); see the module docstring."""
        self.rotation = 0
        """Rank r trains the block of rank (r + rotation) % world_size: a replica check's retry moves
        the blocks across ranks for one step to tell a bad batch from a bad node
        (elastic._worker.integrity.replica_check). Never part of the state."""

    def check_shares(self, shares: object) -> tuple[int, ...]:
        """`shares` as a split of a global batch of this sampler (ValueError, one line, if it is none)."""
        if not isinstance(shares, (list, tuple)) or not shares or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shares):
            raise ValueError(f"shares {shares!r} are not a list of sample counts of at least 1")
        if sum(shares) != self.batch_size * len(shares):
            raise ValueError(f"shares {list(shares)} sum to {sum(shares)}, not the global batch "
                             f"{self.batch_size} x {len(shares)} ranks")
        return tuple(shares)

    def set_shares(self, shares: tuple[int, ...] | None) -> None:
        """Split the global batches to come by `shares` (None: evenly). Every rank must set the same, at the same step."""
        self.shares = None if shares is None else self.check_shares(shares)

    def share(self, rank: int, world_size: int) -> tuple[int, int]:
        """Where rank `rank`'s samples sit in a global batch at `world_size`: (first, count)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        block = (rank + self.rotation) % world_size
        if self.shares is not None and len(self.shares) == world_size:
            return sum(self.shares[:block]), self.shares[block]
        return block * self.batch_size, self.batch_size

    @property
    def state(self) -> SamplerState:
        return self._state

    @property
    def epoch(self) -> int:
        return self._state.epoch

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perm_cache:
            # Keep at most the epochs a batch can straddle: current and following ones.
            for old in [e for e in self._perm_cache if e < self._state.epoch]:
                del self._perm_cache[old]
            self._perm_cache[epoch] = epoch_permutation(self.num_samples, self.seed, epoch)
        return self._perm_cache[epoch]

    def _take(self, state: SamplerState, count: int) -> tuple[torch.Tensor, SamplerState]:
        """The next `count` indices of the stream from `state`, and the state after them."""
        pieces = []
        epoch, consumed = state.epoch, state.consumed
        while count > 0:
            perm = self._permutation(epoch)
            n = min(count, self.num_samples - consumed)
            pieces.append(perm[consumed : consumed + n])
            count -= n
            consumed += n
            if consumed == self.num_samples:
                epoch, consumed = epoch + 1, 0
        return torch.cat(pieces), SamplerState(epoch, consumed)

    def global_batch(self, world_size: int) -> torch.Tensor:
        """Indices of the whole job's next step, rank-major (rank r owns block r)."""
        indices, _ = self._take(self._state, self.batch_size * world_size)
        return indices

    def local_batch(self, rank: int, world_size: int) -> torch.Tensor:
        """This rank's indices of the next step: `batch_size` of them, or its share (does not advance)."""
        start, count = self.share(rank, world_size)
        return self.global_batch(world_size)[start : start + count]

    def advance(self, world_size: int) -> None:
        """Mark the next global batch as consumed by the whole job."""
        _, self._state = self._take(self._state, self.batch_size * world_size)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "seed": self.seed,
            "epoch": self._state.epoch,
            "consumed": self._state.consumed,
            "num_samples": self.num_samples,
        }
        if self.shares is not None:
            state["shares"] = list(self.shares)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position; the data set and seed must be the ones it was taken with."""
        if int(state["num_samples"]) != self.num_samples:
            raise ValueError(
                f"sampler state is for {int(state['num_samples'])} samples, this data set has {self.num_samples}"
            )
        if int(state["seed"]) != self.seed:
            raise ValueError(f"sampler state has seed {int(state['seed'])}, this run uses seed {self.seed}")
        consumed = int(state["consumed"])
        if not 0 <= consumed < self.num_samples:
            raise ValueError(f"sampler state consumed={consumed} is outside 0..{self.num_samples - 1}")
        shares = self.check_shares(state["shares"]) if "shares" in state else None
        self._state = SamplerState(int(state["epoch"]), consumed)
        self.shares = shares
        self._perm_cache.clear()
