"""Where a node's snapshot parts get their copy: the keeper of the next node, in a ring.

Each worker copies its part to one peer node's keeper (elastic._worker.checkpoint.memory), so a node's
loss leaves a copy. The ring is the job's nodes in the order of their lowest rank; a node's peer is the
next one (the last node's is the first). Every rank learns its peer at each restore (`peer_keeper`,
a collective).

Invariants: the nodes are told apart by (node name, keeper URL) as each rank reports them; a job on one
node has no peer (None on every rank).
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
    """A collective: the keeper URL this rank's node copies its parts to (None: one node, no peer)."""
    nodes: list[KeeperSeen] = []
    for seen in agreement.all_gather(ctx, mine, KeeperSeen, group):
        if seen not in nodes:
            nodes.append(seen)
    if len(nodes) < 2:
        return None
    return nodes[(nodes.index(mine) + 1) % len(nodes)].url
