"""What ranks exchange in collectives stays small as the job grows: counted on a process group of threads
(benchmarks/scale_count.py's SimGroup, which counts the bytes each rank receives) at two sizes, and the
straggler decision's work counted in comparisons."""

from __future__ import annotations

import statistics
import threading
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_benchmark_tables import script

from elastic._worker.integrity.digest_exchange import exchange
from elastic._worker.observe.stragglers import MAX_FIGURE, slowdowns
from elastic._worker.runtime.context import WorkerContext


def ranks(size: int, body: Any) -> tuple[list[Any], list[Any]]:
    """`body(ctx, group)` on `size` threads of one SimWorld: (results by rank, the ranks' tallies)."""
    world = script("scale_count").SimWorld(size, timeout=120)
    groups, results = world.groups(), [None] * size

    def run(rank: int) -> None:
        ctx = WorkerContext(rank=rank, local_rank=rank % 8, world_size=size, local_world_size=8, restart_count=0,
                            run_id="t", device=torch.device("cpu"), backend="gloo")
        results[rank] = body(ctx, groups[rank])

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return results, world.tallies


def test_a_replica_check_that_agrees_moves_a_few_bytes_a_rank_at_any_size() -> None:
    received = {}
    for size in (8, 64):
        results, tallies = ranks(size, lambda ctx, group: exchange(ctx, "ab" * 32, 3 + ctx.rank % 4, group))
        assert all(r.digests == ["ab" * 32] * size and max(r.proposals) == 6 for r in results)
        received[size] = max(t.collective_bytes for t in tallies)
    assert received[64] <= 1.5 * received[8], received  # an all-gather of every rank's row grew 8 times


def test_a_replica_check_that_differs_gathers_every_digest_and_names_the_odd_rank() -> None:
    def body(ctx: WorkerContext, group: Any) -> Any:
        return exchange(ctx, ("cd" if ctx.rank == 5 else "ab") * 32, 4, group)

    results, _ = ranks(8, body)
    assert all(r.digests[5] == "cd" * 32 and r.digests.count("ab" * 32) == 7 and r.proposals == [4] * 8 for r in results)


def brute_force(figures: list[int]) -> list[float | None]:
    """The definition: each figure over the median of every other rank's."""
    valid = [f if 0 < f <= MAX_FIGURE else None for f in figures]
    result: list[float | None] = []
    for rank, figure in enumerate(valid):
        others = [f for other, f in enumerate(valid) if other != rank and f is not None]
        result.append(None if figure is None or not others else figure / statistics.median(others))
    return result


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.integers(min_value=-5, max_value=40), max_size=12))
def test_the_slowdowns_are_each_figure_over_the_median_of_the_others(figures: list[int]) -> None:
    assert slowdowns(figures) == brute_force(figures)


class Counted(int):
    """A figure that counts its comparisons."""

    compared = 0

    def __lt__(self, other: object) -> bool:
        Counted.compared += 1
        return int(self) < int(other)


def test_a_votes_decision_compares_n_log_n_figures_not_n_squared() -> None:
    comparisons = {}
    for size in (16, 256):
        Counted.compared = 0
        slowdowns([Counted(1000 + (rank * 7919) % 97) for rank in range(size)])
        comparisons[size] = Counted.compared
    assert comparisons[256] <= 1.5 * (256 * 8) / (16 * 4) * comparisons[16], comparisons
