"""How a global batch is split between ranks of different speeds: the math of `--slow-ranks rebalance`.

Invariants:
- `balanced_shares` gives the split of `total` samples with the shortest step (`step_time`): every
  rank at least one sample, the sum exactly `total`, each further sample to the rank that would end
  it soonest (ties to the lower rank). A rank at half speed gets about half the samples of the
  others. A function of its inputs alone, so every rank computes the same split from the same figures.
- `step_time` is what a split costs: the slowest rank's share times its time per sample (the
  all-reduce waits for it).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def balanced_shares(per_sample: Sequence[float], total: int) -> tuple[int, ...]:
    """The split of `total` samples between ranks of time `per_sample` each (> 0) with the shortest step."""
    if total < len(per_sample) or not per_sample:
        raise ValueError(f"{total} samples cannot give each of {len(per_sample)} ranks one")
    if not all(t > 0 for t in per_sample):
        raise ValueError(f"times per sample {list(per_sample)} must all be above 0")
    shares = [1] * len(per_sample)
    ends = [(2 * t, rank) for rank, t in enumerate(per_sample)]  # when each rank would end with one more
    heapq.heapify(ends)
    for _ in range(total - len(shares)):
        _, rank = heapq.heappop(ends)
        shares[rank] += 1
        heapq.heappush(ends, ((shares[rank] + 1) * per_sample[rank], rank))
    return tuple(shares)


def step_time(shares: Sequence[int], per_sample: Sequence[float]) -> float:
    """The time of a step split by `shares`: the slowest rank's."""
    return max(n * t for n, t in zip(shares, per_sample))
