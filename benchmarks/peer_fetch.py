"""A restore's reads from a live peer's keeper: a connection per range against kept connections.

A rank that restores another node's part reads it by signed HTTP range requests
(`keeper_client`), one request per span its plan reads; a reshard reads many small
spans (about one per tensor). This measures, against a real snapshot keeper in a
process of its own, `--mb` of one part read as ranges of `--range-kb`:

- fresh: a connection per range (`keeper_client.get_range`, as before kept connections);
- kept: `keeper_client.KeeperConnections`, what a restore uses now (one connection);
- for scale, the same bytes copied from a local memory buffer, the bound on any transport.

Rounds alternate the two sides; prints medians, GB/s, connections opened and the ratios.

    python benchmarks/peer_fetch.py [--mb 256] [--range-kb 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import memory_copies, memory_dir  # noqa: E402
from snapshot_auth import served_keeper  # noqa: E402 - a keeper with one part of random bytes

from elastic._shared.storage.keeper_address import LOCAL  # noqa: E402
from elastic._shared.storage.peer_auth import PeerKey  # noqa: E402
from elastic._worker.checkpoint import keeper_client  # noqa: E402


def read_all(fetch, part_url: str, key: PeerKey, size: int, span: int) -> float:
    started = time.perf_counter()
    for start in range(0, size, span):
        got = fetch(part_url, key, start, min(start + span, size), 60)
        if len(got) != min(span, size - start):
            raise RuntimeError(f"short range at {start}: {len(got)} bytes")
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="bytes read per side and round, in MB")
    parser.add_argument("--range-kb", type=int, default=256, help="bytes per range request, in KB")
    parser.add_argument("--rounds", type=int, default=5)
    opts = parser.parse_args(argv)
    if opts.mb < 1 or opts.range_kb < 1 or opts.rounds < 1:
        parser.error("--mb, --range-kb and --rounds must be at least 1")
    size, span, secret = opts.mb * 2**20, opts.range_kb * 2**10, os.urandom(32)
    times: dict[str, list[float]] = {"fresh": [], "kept": []}
    opened: list[int] = []
    with tempfile.TemporaryDirectory(prefix="peer-fetch-", dir=memory_dir()) as base, \
            served_keeper(secret, base, True, size) as (url, name):
        part_url, key = f"{url}/part/{LOCAL}/{name}", PeerKey(secret)
        for round_ in range(opts.rounds):
            for side in (("fresh", "kept") if round_ % 2 == 0 else ("kept", "fresh")):
                if side == "fresh":
                    times[side].append(read_all(keeper_client.get_range, part_url, key, size, span))
                else:
                    connections = keeper_client.KeeperConnections()
                    try:
                        times[side].append(read_all(connections.get_range, part_url, key, size, span))
                        opened.append(connections.opened)
                    finally:
                        connections.close()
    copies = memory_copies(size, opts.rounds)
    print("\n".join(report(opts, times, copies, opened)))
    return 0


def report(opts: argparse.Namespace, times: dict[str, list[float]], copies: list[float], opened: list[int]) -> list[str]:
    """The lines printed from the rounds' seconds per side (`fresh`, `kept`), the memory copies' seconds
    and the connections each kept-connections round opened: medians, GB/s and the ratios."""
    size, span = opts.mb * 2**20, opts.range_kb * 2**10
    requests = -(-size // span)
    fresh, kept, copy = (statistics.median(times["fresh"]), statistics.median(times["kept"]),
                         statistics.median(copies))
    return [
        f"{opts.mb} MB from a peer keeper in {requests} signed range requests of {opts.range_kb} KB "
        f"({opts.rounds} rounds, medians):",
        f"  connection per range   {fresh:.3f} s  {size / fresh / 1e9:.2f} GB/s  {requests} connections",
        f"  kept connections       {kept:.3f} s  {size / kept / 1e9:.2f} GB/s  {max(opened)} connection(s)",
        f"  local memory copy      {copy:.3f} s  {size / copy / 1e9:.2f} GB/s",
        f"kept / per range: {fresh / kept:.2f}x faster; kept / memory copy: {copy / kept:.3f} of its speed",
    ]


if __name__ == "__main__":
    sys.exit(main())
