"""The memory restore's lookup costs a rank O(1) bytes of placement and RNG whatever the job's size: the keepers'
ring is decided by rank 0 and scattered, each node's ranks report its parts once between them, and each rank
receives its own old rank's RNG state, not every rank's. Counted on a process group of threads (SimGroup) at
two sizes; each fails on the all-gather or broadcast it replaced."""

from __future__ import annotations

from typing import Any

import torch
from test_collective_scale import ranks

from elastic._worker.checkpoint.keeper_ring import KeeperSeen, peer_keeper, ring_peers, share_of_node
from elastic._worker.checkpoint.sources import Decision, Offer, share_rngs, without_rngs
from elastic._worker.control import agreement


def seen_by(rank: int) -> KeeperSeen:
    node = rank // 8
    return KeeperSeen(f"node{node}", f"http://10.0.0.{node}:7070")


def test_each_rank_learns_the_next_nodes_keeper_for_a_few_bytes_at_any_size() -> None:
    received = {}
    for size in (16, 128):
        peers, tallies = ranks(size, lambda ctx, group: peer_keeper(ctx, seen_by(ctx.rank), group))
        nodes = size // 8
        assert peers == [f"http://10.0.0.{(rank // 8 + 1) % nodes}:7070" for rank in range(size)]
        received[size] = max(t.collective_bytes for t in tallies[1:])  # rank 0 hears every node: once
    assert received[128] <= 1.5 * received[16], received


def test_one_node_has_no_peer_and_the_ring_follows_the_lowest_ranks() -> None:
    assert ring_peers([seen_by(0)] * 3) == [None, None, None]
    a, b, c = KeeperSeen("a", "u-a"), KeeperSeen("b", "u-b"), KeeperSeen("c", "u-c")
    assert ring_peers([b, b, a, c, a]) == ["u-a", "u-a", "u-c", "u-b", "u-c"]


def test_the_ranks_of_a_node_report_each_part_once_between_them() -> None:
    from test_collective_scale import WorkerContext

    held = [["local", f"part{r}"] for r in range(8, 16)] + [["replica", f"part{r}"] for r in range(0, 8)]
    old_ranks = [*range(8, 16), *range(0, 8)]
    reported = []
    for local in range(8):
        ctx = WorkerContext(rank=8 + local, local_rank=local, world_size=16, local_world_size=8, restart_count=0,
                            run_id="t", device=torch.device("cpu"), backend="gloo")
        reported += share_of_node(ctx, held, old_ranks)
    assert sorted(map(tuple, reported)) == sorted(map(tuple, held))


def offer(size: int) -> Offer:
    rngs = [{"torch": torch.full((5056,), rank % 251, dtype=torch.uint8)} for rank in range(size)]
    return Offer(source="memory", name="the in-memory snapshot of step 9", checkpoint="step_00000009",
                 manifest="{}", trainer={"sampler": {}, "rng": rngs}, tensors_json=None, locations={})


def test_each_rank_receives_its_own_rng_state_not_every_ranks() -> None:
    received = {}
    for size in (8, 64):
        def body(ctx: Any, group: Any) -> bool:
            decision, rngs = without_rngs(Decision(offer=offer(size)))
            shared = agreement.from_main(ctx, decision if ctx.is_main else None, Decision, group)
            share_rngs(ctx, shared.offer, rngs if ctx.is_main else None, group)
            mine = shared.offer.trainer["rng"]
            return len(mine) == size and int(mine[ctx.rank]["torch"][0]) == ctx.rank % 251

        results, tallies = ranks(size, body)
        assert all(results)
        received[size] = max(t.collective_bytes for t in tallies[1:])
    assert received[64] <= 1.5 * received[8], received  # broadcast whole, 64 states were 8 times 8 states
