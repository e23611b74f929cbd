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

`retried` reads the third try of a mismatch that the replay repeated: the
one step where the replay first diverged, trained again from the step
before it, with the per-rank blocks of the global batch rotated (rank r
trains the block rank r + `shift` trained; `shift` 0 when the loader cannot
move them):

- the divergence moves with the blocks (the odd ranks are the replay's
  shifted back, or, with two ranks, the two digests swap places): the
  `batch` is at fault, whichever rank trains it;
- it stays with the rank (the replay's odd ranks again; with two ranks, the
  one rank whose own digest changed while its peer repeated the healthy
  result): that rank's `node`;
- with two ranks that both repeat their digests, nothing tells them apart
  (`node`, no rank named).

The numeric guard names a batch of its own the same way: a step caught under
`rollback` whose replay is caught again (elastic._worker.integrity.numeric_guard).

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
    """`transient`, `node` or `batch`."""
    ranks: tuple[int, ...]
    """The ranks at fault (`batch`: the ranks that trained the bad block(s) when the fault was found); empty
    when nothing tells them apart (two ranks that both repeat their digests)."""
    blocks: tuple[int, ...] = ()
    """`batch`: the blocks of the global batch at fault (rank r's block is block r when not rotated); with
    two ranks both blocks (which half holds the fault cannot be told)."""


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


def retried(replay: list[str], retry: list[str], shift: int) -> Classified:
    """The mismatch the replay repeated (`replay`: digests by rank at the step the replay first
    diverged), tried once more from the step before it with the blocks rotated by `shift`
    (`retry`). `node` or `batch` (see the module docstring)."""
    world = len(replay)
    if len(retry) != world:
        raise ValueError(f"{world} replayed digests, {len(retry)} retried: not the same ranks")
    moved = shift % world != 0
    first, again = compare(replay), compare(retry)
    if first.odd:  # three ranks or more: the majority names the odd ranks of each try
        followed = tuple(sorted((r - shift) % world for r in first.odd))
        if moved and again.odd and again.odd == followed and followed != first.odd:
            return Classified(BATCH, first.odd, first.odd)
        return Classified(NODE, first.odd)
    if moved and not again.agreed and all(retry[r] == replay[(r + shift) % world] for r in range(world)):
        return Classified(BATCH, (), tuple(range(world)))  # each result followed its block
    # A healthy rank computes the same step from the same state twice (two ranks' sum of gradients is
    # the same in either order); a rank whose own result changed computed differently from itself.
    changed = tuple(r for r in range(world) if replay[r] != retry[r])
    return Classified(NODE, changed if 0 < len(changed) < world else ())
