"""What a replica check's digests say, and what a mismatch was once it has been replayed. Pure: no I/O.

Under DDP every rank ends each step with bit-identical parameters, so the
ranks' parameter digests (elastic._worker.observe.replicas.parameter_digest)
are all equal; anything else is a silent fault. `compare` reads one round of
digests: with three or more ranks a strict majority names the odd rank(s);
with two ranks, or no majority, nobody is named yet. `classify` reads two
rounds of the same step, the first and the one after rolling back and
replaying the steps since the last passing check:

- the replay agrees: the fault was `transient` (named by the first round's
  majority: the odd rank's wrong gradients reached its peers through the
  all-reduce, so every rank's first digest differs from the replay's, and two
  ranks cannot be told apart);
- the ranks differ again: the odd rank(s) of the replay (by majority; with
  two ranks, the rank whose own digest changed between the two tries) sit on
  a faulty `node`.

A fault that follows the batch (the same samples make the same step go
wrong whichever rank trains them) is the numeric guard's to name
(elastic._worker.integrity.numeric_guard): a replay of the same batch fails
the same way.

Invariants: the functions depend only on their arguments; every rank calls
them with the same gathered digests, so every rank reaches the same verdict.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

TRANSIENT = "transient"
NODE = "node"
BATCH = "batch"
KINDS = (TRANSIENT, NODE, BATCH)
"""The kinds of a `corruption` event (`batch`: the numeric guard's, a batch that fails again on replay)."""


@dataclass(frozen=True)
class Comparison:
    """One round of digests, read."""

    agreed: bool
    """Every rank holds the same digest."""
    majority: str | None
    """The digest more than half of the ranks hold (None: no strict majority, or two ranks that differ)."""
    odd: tuple[int, ...]
    """The ranks whose digest is not the majority's (empty when there is none to name)."""


def compare(digests: list[str]) -> Comparison:
    """`digests` by rank (at least one)."""
    if not digests:
        raise ValueError("no digests to compare")
    if len(set(digests)) == 1:
        return Comparison(True, digests[0], ())
    counts = Counter(digests)
    digest, held = counts.most_common(1)[0]
    if len(digests) < 3 or 2 * held <= len(digests):
        return Comparison(False, None, ())
    return Comparison(False, digest, tuple(rank for rank, d in enumerate(digests) if d != digest))


@dataclass(frozen=True)
class Classified:
    """What a mismatch was, once replayed."""

    kind: str
    """`transient` or `node`."""
    ranks: tuple[int, ...]
    """The ranks at fault; empty when nothing tells them apart (two ranks that both repeat their digests)."""


def classify(first: list[str], replay: list[str]) -> Classified:
    """The mismatch of `first` (digests by rank at a check step), replayed into `replay` (the same
    step's digests after rolling back every rank to the last passing check)."""
    if len(first) != len(replay):
        raise ValueError(f"{len(first)} first digests, {len(replay)} replayed: not the same ranks")
    again = compare(replay)
    if again.agreed:  # the odd rank's fault reached its peers through the gradients: only a majority names it
        return Classified(TRANSIENT, compare(first).odd)
    if again.odd:
        return Classified(NODE, again.odd)
    # Two ranks (or no majority) that differ again: a rank whose digest changed between the two
    # tries computed differently from itself; one that repeated its own result is consistent.
    moved = tuple(r for r, (a, b) in enumerate(zip(first, replay)) if a != b)
    return Classified(NODE, moved if 0 < len(moved) < len(first) else ())
