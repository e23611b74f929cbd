"""The control-plane simulator (benchmarks/scale.py) at 16 and 64 simulated ranks, threads of this process on a
TCPStore served here: every worker-side path's per-rank cost is what the code promises and does not grow with
the job. (The rendezvous paths patch torch's registry, so they run only in the simulator's own processes;
their heartbeats are counted at two sizes in tests/unit/test_rendezvous_liveness.py.)"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType
from typing import Any

import pytest
from support import REPO

SIZES = (16, 64)


def script(name: str) -> ModuleType:
    """benchmarks/`name`.py (the simulator's scripts import their siblings by plain name)."""
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.append(str(REPO / "benchmarks"))
    return importlib.import_module(name)

PATHS = ("hang", "views", "notice-board", "memory-restore", "replica-check", "vote-slots")


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, dict[str, Any]]]:
    scale = script("scale")
    figures: dict[str, dict[int, dict[str, Any]]] = {}
    with pytest.MonkeyPatch.context() as patch:  # never left for the worker's later tests (their jobs would be signed)
        if not os.environ.get("TORCHREVIVE_SNAPSHOT_SECRET"):
            patch.setenv("TORCHREVIVE_SNAPSHOT_SECRET", "s" * 32)  # records sealed, as in a job
        for path in PATHS:
            for n in SIZES:
                phases = scale.run_here(path, n, pool=4)
                for row in (r for r in scale.rows() if r.path == path):
                    figures.setdefault(row.name, {})[n] = scale.entry(row, phases[row.phase], n)
    return figures


def test_every_path_costs_a_rank_what_it_promises_at_16_and_64_ranks(table: dict[str, dict[int, dict[str, Any]]]) -> None:
    scale_model = script("scale_model")
    hang = table["hang: look while stalled"]
    for n in SIZES:
        assert hang[n]["max_ops_per_rank"] <= 4, hang[n]  # every rank but the reader, at every look
        assert hang[n]["verdicts"] == [(n // 2,)], "the silent rank is named, once"
        assert table["hang: look between failures"][n]["ops_per_rank"] == 0, "no store operation between failures"
        assert table["notice board: a post read by all"][n]["ops_per_rank"] <= 5
        assert table["vote: --slow-ranks figures, per vote"][n]["ops_per_rank"] == 1, "one collective a vote"
        assert table["replica check: digest exchange, per check"][n]["ops_per_rank"] == 1
    for name, by_n in table.items():
        ratio = by_n[64]["ops_per_rank"] / max(by_n[16]["ops_per_rank"], 1e-9)
        assert ratio <= 1.5, f"{name}: {by_n[16]['ops_per_rank']} -> {by_n[64]['ops_per_rank']} operations a rank"
        assert scale_model.growth({n: f["ops_per_rank"] for n, f in by_n.items()}) in ("constant", "log"), name
    check = table["replica check: digest exchange, per check"]
    assert check[64]["bytes_per_rank"] <= 1.5 * check[16]["bytes_per_rank"], check  # an all-gather grew 4x
    lookup = table["memory restore: lookup and placement"]
    assert lookup[64]["bytes_per_rank"] <= 2.5 * lookup[16]["bytes_per_rank"], lookup  # was 4x: O(N) a rank
    assert lookup[64]["aggregator_ops"] is not None
