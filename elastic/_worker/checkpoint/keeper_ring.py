"""Where a node's snapshot parts get their copy: the keeper of the next node, in a ring.

Each worker copies its part to one peer node's keeper (elastic._worker.checkpoint.memory), so a node's
loss leaves a copy. The ring is the job's nodes in the order of their lowest rank; a node's peer is the
next one (the last node's is the first). Every rank learns its peer at each restore (`peer_keeper`,
a collective), and reports its share of what its node holds (`share_of_node`).

Invariants: the nodes are told apart by (node name, keeper URL) as each rank reports them; a job on one
node has no peer (None on every rank); a node's ranks 0..local_world_size-1 report every part it holds
exactly once between them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastic._worker.control import agreement
from elastic._worker.runtime.context import WorkerContext


@dataclass(frozen=True)
class KeeperSeen(agreement.Message):
    """A rank's node and its keeper, as every rank learns them (`connect`)."""

    node: str
    url: str


def peer_keeper(ctx: WorkerContext, mine: KeeperSeen, group: Any = agreement.DEFAULT_GROUP) -> str | None:
    """A collective: the keeper URL this rank's node copies its parts to (None: one node, no peer). Rank 0
    hears every rank's keeper (a gather) and tells each rank its peer (a scatter): O(1) a rank, O(N) at
    rank 0, where every rank hearing every keeper was O(N) bytes a rank and O(N^2) work on each."""
    seen = agreement.gather_to_main(ctx, mine, KeeperSeen, group)
    peers = [agreement.Text(peer or "") for peer in ring_peers(seen)] if seen is not None else None
    told = agreement.scatter_from_main(ctx, peers, agreement.Text, group)
    return told.text if told is not None and told.text else None


def ring_peers(seen: list[KeeperSeen]) -> list[str | None]:
    """Each rank's peer keeper, by rank, from every rank's node (`seen`): the next node in a ring of the
    nodes in the order of their lowest rank."""
    order: dict[KeeperSeen, int] = {}
    for node in seen:
        order.setdefault(node, len(order))
    if len(order) < 2:
        return [None] * len(seen)
    nodes = list(order)
    return [nodes[(order[node] + 1) % len(nodes)].url for node in seen]


def share_of_node(ctx: WorkerContext, held: list[list[str]], ranks: list[int]) -> list[list[str]]:
    """Of what this rank's node holds (`held`, the parts of old ranks `ranks`), what this rank reports
    at a restore: the parts of the old ranks congruent to its local rank, so the node's ranks report
    each part once between them (every one of them reporting all of them cost rank 0 N x the node's)."""
    width = max(ctx.local_world_size, 1)
    return [entry for entry, rank in zip(held, ranks) if rank % width == ctx.local_rank % width]
