"""A replica check's exchange: whether every rank's parameter digest is the same, for a few bytes a rank.

Each check needs, on every rank, whether all digests agree and the largest proposed interval; only a
mismatch (rare: a corruption) needs every rank's digest, to name the odd one. So `exchange` takes one
all-reduce of a fixed row: the digest's eight 32-bit words, their negations and the proposal, under MAX:
the maximum of the words and, negated, their minimum. Equal everywhere means every rank holds the same
digest (a word's maximum and minimum agree on every word). Only then is every rank's row gathered (an
all-gather: O(N) bytes a rank, once per mismatch). A check cost every rank an all-gather of N rows before:
40 bytes x N, 160 KB a rank at 4,096 ranks, at every check.

Invariants: every rank takes the same branch (the all-reduce's result is the same on every rank); a row
that is malformed (a digest of another length, a proposal out of range) is a one-line `ElasticError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from elastic._shared.common.errors import ElasticError
from elastic._worker.control import agreement
from elastic._worker.integrity.check_interval import MAX_EVERY
from elastic._worker.runtime.context import WorkerContext

DIGEST_BYTES = 32
_WORDS = DIGEST_BYTES // 4


@dataclass(frozen=True)
class Gathered:
    """One check's exchange, every rank's part, checked."""

    digests: list[str]
    proposals: list[int]


def encode_ballot(digest: str, every: int) -> torch.Tensor:
    raw = bytes.fromhex(digest)
    if len(raw) != DIGEST_BYTES:
        raise ValueError(f"a digest is {DIGEST_BYTES} bytes, not {len(raw)}")
    return torch.tensor(list(raw) + list(int(every).to_bytes(8, "little")), dtype=torch.uint8)


def decode_ballots(rows: list[torch.Tensor]) -> Gathered:
    """Every rank's (digest, proposal) from the gathered rows; a malformed row is a one-line error."""
    digests, proposals = [], []
    for rank, row in enumerate(rows):
        data = bytes(row.tolist())
        if len(data) != DIGEST_BYTES + 8:
            raise ElasticError(f"replica check: rank {rank} sent {len(data)} bytes, not {DIGEST_BYTES + 8}")
        every = int.from_bytes(data[DIGEST_BYTES:], "little")
        _check_every(every, f"rank {rank}")
        digests.append(data[:DIGEST_BYTES].hex())
        proposals.append(every)
    return Gathered(digests, proposals)


def _check_every(every: int, who: str) -> None:
    if not 1 <= every <= MAX_EVERY:
        raise ElasticError(f"replica check: {who} proposed an interval of {every} steps")


def exchange(ctx: WorkerContext, digest: str, proposal: int, group: Any = agreement.DEFAULT_GROUP) -> Gathered:
    """Every rank's digest and proposal (see the module docstring): when all digests agree, this rank's
    digest for every rank and the largest proposal for every rank; otherwise what each rank sent."""
    raw = bytes.fromhex(digest)
    if len(raw) != DIGEST_BYTES:
        raise ValueError(f"a digest is {DIGEST_BYTES} bytes, not {len(raw)}")
    words = [int.from_bytes(raw[i : i + 4], "little") for i in range(0, DIGEST_BYTES, 4)]
    reduced = agreement.start_max(ctx, [*words, *(-w for w in words), int(proposal)], group).result()
    if all(reduced[i] == -reduced[_WORDS + i] for i in range(_WORDS)):  # every word's max is its min
        largest = reduced[2 * _WORDS]
        _check_every(largest, "a rank")
        return Gathered([digest] * ctx.world_size, [largest] * ctx.world_size)
    return decode_ballots(agreement.all_gather_rows(ctx, encode_ballot(digest, proposal), group))
