"""What sealing every value the job reads from a store costs: a rendezvous round, and a process group's start.

Measured side by side in one run, sealed and unsealed in alternation (pairs), on a real TCPStore on
loopback in this process:

- a rendezvous round: `--agents` agents (threads, each a handler as `handlers.create_c10d_sealed` makes
  it: sealed with a secret, or the same handler with none) meet again after their first round, as after
  a failure, and then assign their workers' ranks as torch's agent does (`_assign_worker_ranks`, through
  the round's store); timed from the first agent's join to the last agent's ranks;
- a process group's start: `--ranks` ranks (threads) build a gloo group on a worker store, through a
  `SealedStore` in the round's scope or on the TCPStore itself, and all-reduce one tensor.

Prints medians (milliseconds) and the ratio sealed / unsealed; `--json FILE` writes them with their
provenance (benchmarks/provenance.py). Figures on a loaded machine measure the load too: compare the
ratio, and re-measure on an idle one.

    python benchmarks/seal_cost.py [--agents 4] [--ranks 4] [--pairs 7] [--json FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerSpec  # noqa: E402
from torch.distributed.elastic.rendezvous import RendezvousParameters  # noqa: E402

from elastic._agent.rendezvous import c10d_store  # noqa: E402
from elastic._agent.rendezvous.guarded_c10d import C10dStateBackend  # noqa: E402
from elastic._agent.rendezvous.handlers import SealedHandler, build  # noqa: E402
from elastic._agent.rendezvous.state_guard import StateGuard  # noqa: E402
from elastic._shared.protocol import round_identity  # noqa: E402
from elastic._shared.storage.peer_auth import PeerKey  # noqa: E402
from elastic._shared.storage.sealed_store import SealedStore  # noqa: E402
from provenance import write_result  # noqa: E402 - a sibling (benchmarks/ is no package)

KEY = PeerKey(b"s" * 32)
SIDES = ("unsealed", "sealed")


def handler(port: int, run_id: str, agents: int, key: PeerKey | None) -> SealedHandler:
    """An agent's handler, as `create_c10d_sealed` makes it, with `key` as the job's secret (None: unsigned)."""
    params = RendezvousParameters(
        backend="c10d-sealed", endpoint=f"127.0.0.1:{port}", run_id=run_id, min_nodes=agents, max_nodes=agents,
        is_host="0", join_timeout="120", last_call_timeout="30", keep_alive_interval="1", keep_alive_max_attempt="3",
        read_timeout="120",
    )
    inner = c10d_store.create_store(params)
    guard = StateGuard.for_run(run_id, key)
    return build(params, C10dStateBackend(inner, run_id, guard, name=params.backend), inner, key, watch=False)


def together(bodies: list[Callable[[], Any]]) -> float:
    """Seconds from the start of `bodies` (one thread each) to the end of the last; the first error raised."""
    errors: list[BaseException] = []

    def run(body: Callable[[], Any]) -> None:
        try:
            body()
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(body,), daemon=True) for body in bodies]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    if errors:
        raise errors[0]
    return time.perf_counter() - started


def rendezvous_round(port: int, agents: int, key: PeerKey | None) -> float:
    """Seconds of one round after the first, and the ranks it assigns (see the module docstring)."""
    run_id = f"seal-{uuid.uuid4().hex[:8]}"
    handlers = [handler(port, run_id, agents, key) for _ in range(agents)]

    def meet(one: SealedHandler) -> None:
        info = one.next_rendezvous()
        spec = WorkerSpec(role="default", local_world_size=1, rdzv_handler=one, entrypoint="x")
        SimpleElasticAgent._assign_worker_ranks(None, info.store, info.rank, info.world_size, spec)  # type: ignore[arg-type]

    try:
        together([lambda h=h: meet(h) for h in handlers])  # the first round (torch delays it at random)
        return together([lambda h=h: meet(h) for h in handlers])
    finally:
        for one in handlers:
            one._stop_heartbeats()


def group_start(ranks: int, key: PeerKey | None) -> float:
    """Seconds for `ranks` ranks to build a gloo group on a fresh worker store and all-reduce once."""
    server = dist.TCPStore("127.0.0.1", 0, None, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    scope = round_identity.worker_scope("seal", round_identity.RoundIdentity("a" * 32, 1))

    def rank(r: int) -> None:
        inner = dist.TCPStore("127.0.0.1", server.port, None, is_master=False, timeout=timedelta(seconds=60))
        store = SealedStore(inner, key, scope) if key is not None else inner
        group = dist.ProcessGroupGloo(dist.PrefixStore("0", store), r, ranks, timedelta(seconds=60))
        group.allreduce([torch.ones(1)]).wait()

    return together([lambda r=r: rank(r) for r in range(ranks)])


def measure(what: Callable[[PeerKey | None], float], pairs: int) -> dict[str, list[float]]:
    """`what` unsealed and sealed in alternation, `pairs` times each (milliseconds), after one warm-up of each."""
    for key in (None, KEY):
        what(key)
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for _ in range(pairs):
        for side, key in zip(SIDES, (None, KEY), strict=True):
            times[side].append(what(key) * 1000)
    return times


def row(name: str, times: dict[str, list[float]]) -> dict[str, Any]:
    medians = {side: statistics.median(times[side]) for side in SIDES}
    return {"what": name, **{f"{side}_ms": round(medians[side], 2) for side in SIDES},
            "ratio": round(medians["sealed"] / medians["unsealed"], 3) if medians["unsealed"] else None,
            "samples": {side: [round(t, 2) for t in times[side]] for side in SIDES}}


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'what':<28} {'unsealed ms':>12} {'sealed ms':>10} {'sealed/unsealed':>16}"]
    lines += [f"{r['what']:<28} {r['unsealed_ms']:>12.2f} {r['sealed_ms']:>10.2f} {r['ratio']:>16.3f}" for r in rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=4, help="agents meeting in each rendezvous round")
    parser.add_argument("--ranks", type=int, default=4, help="ranks of each process group")
    parser.add_argument("--pairs", type=int, default=7, help="sealed/unsealed pairs of each measurement")
    parser.add_argument("--json", type=Path, help="write the figures and their provenance to this file")
    args = parser.parse_args(argv)
    if not (2 <= args.agents <= 64 and 2 <= args.ranks <= 64 and 1 <= args.pairs <= 1000):
        parser.error("--agents and --ranks take 2 to 64, --pairs 1 to 1000")
    return args


def measured_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Both measurements (see the module docstring), on a rendezvous store served here."""
    server = dist.TCPStore("127.0.0.1", 0, None, is_master=True, multi_tenant=True,
                           timeout=timedelta(seconds=120), wait_for_workers=False)
    return [
        row(f"rendezvous round, {args.agents} agents",
            measure(lambda k: rendezvous_round(server.port, args.agents, k), args.pairs)),
        row(f"process group start, {args.ranks} ranks", measure(lambda k: group_start(args.ranks, k), args.pairs)),
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = measured_rows(args)
    print(table(rows))
    if args.json is not None:
        write_result(args.json, "seal_cost", {"agents": args.agents, "ranks": args.ranks, "pairs": args.pairs,
                                              "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
