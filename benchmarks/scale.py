"""The control plane at thousands of ranks, by simulation: every path's cost per rank as the job grows.

    python benchmarks/scale.py                                  # N = 16, 64, 256, 1024; every path
    python benchmarks/scale.py --sizes 16,64 --paths hang,views --procs 1
    python benchmarks/scale.py --sizes 16,64,256,1024,4096 --json scale.json

N simulated ranks (or nodes: one agent per node) run the project's real code for one path at a
time, as threads spread over `--procs` processes, against a real store: torch's TCPStore (libuv)
served here, and a real etcd started on a free loopback port (etcd-server). Models and collectives
are stand-ins at the narrowest seam: a path that agrees through collectives runs on a process group
of threads that counts the bytes each rank would move. Every store client is wrapped in a counting
adapter (scale_count.py); nothing of torch is patched in the library.

The paths (scale_paths.py, scale_collective.py, scale_rdzv.py):
- a rendezvous round, the first and one after a lost node, on c10d (torchrevive-run's c10d-sealed
  handler), on etcd-v3, and on torch's stock c10d handler, side by side;
- the steady state between failures: each agent's keep-alive heartbeats and its looks (per second),
  the workers' vote steps (store operations per step; the vote's bytes);
- a hang's comparison with one silent rank (per look);
- train-on after a lost node: the survivors' shrink, and the replacements joining (the views);
- the memory restore's lookup: the keepers' peer placement and every node's parts to rank 0;
- a notice posted by one agent and read by every agent;
- the replica check's digest exchange and the `--slow-ranks` figures on the vote.

For each path and N it prints the median rank's store operations and bytes per event, the
aggregator's (a path may have one rank that does O(N) once), the busiest store's operations per
second and the wall time; it fits the growth (constant, log, linear, quadratic) of the per-rank
operations and names the worst path; then the capacity model: the store load of a job of 1k, 4k and
16k ranks during a failure and between failures, from the per-rank figures, and the store it needs.
`--json FILE` writes it all with its provenance (benchmarks/provenance.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scale_model  # noqa: E402 - benchmarks import their siblings by plain name
from common import comma_list, fail  # noqa: E402
from scale_model import Row, once, per_count  # noqa: E402
from scale_sim import RESULT, Phase, Slice, run_threads, serve_store, spread  # noqa: E402

PROG = "scale.py"
DEFAULT_SIZES = (16, 64, 256, 1024)


def per_look(phase: Phase, n: int) -> float:
    looked = len(phase.ops)
    return phase.extra.get("looks", looked) / max(looked, 1)


def rows() -> list[Row]:
    from scale_collective import ROWS as collective_rows
    from scale_rdzv import ROWS as rdzv_rows

    return [
        *rdzv_rows,
        Row("hang: look while stalled", "hang", "look", per_look, aggregator=True),
        Row("hang: look between failures", "hang", "idle", per_count("idle_looks")),
        Row("views: shrink after a lost node", "views", "leave", once, aggregator=True),
        Row("views: replacements join", "views", "join", once, aggregator=True),
        Row("notice board: a post read by all", "notice-board", "read", once),
        *collective_rows,
    ]


# -- running ---------------------------------------------------------------------------------------------


def run_path(path: str, n: int, *, procs: int, timeout: float) -> dict[str, Phase]:
    """One path at `n` ranks: its phases (store paths over processes, collective paths in this one)."""
    from scale_collective import PATHS as collective_paths
    from scale_rdzv import RANK_BODIES, run_rdzv

    if path in collective_paths:
        sl = Slice(path, n, list(range(n)), None, 0, 1)
        collective_paths[path](sl)
        return sl.phases
    if path in RANK_BODIES:
        return run_rdzv(path, n, procs=procs, timeout=timeout)
    server, control = serve_store(), serve_store()
    try:
        return spread(path, n, procs=procs, store_port=server.port, control_port=control.port, etcd=None,
                      params={}, timeout=timeout)
    finally:
        del server, control


def run_here(path: str, n: int, *, pool: int = 0) -> dict[str, Phase]:
    """One worker-side path at `n` ranks as threads of this process, on a TCPStore served here (what the
    test suite runs, `pool` shared connections; the rendezvous paths patch torch's registry, so they run
    in processes of their own only)."""
    from scale_collective import PATHS as collective_paths
    from scale_paths import PATHS

    if path in collective_paths:
        return run_path(path, n, procs=1, timeout=600)
    server, control = serve_store(), serve_store()
    sl = Slice(path, n, list(range(n)), server.port, control.port, 1, params={"pool": pool})
    run_threads(sl, PATHS[path])
    return sl.phases


def child(spec_text: str) -> None:
    """A child process: run its slice of a path's ranks, print the phases (scale_sim's protocol)."""
    from scale_paths import PATHS
    from scale_rdzv import RANK_BODIES

    spec = json.loads(spec_text)
    sl = Slice(spec["path"], spec["n"], spec["ranks"], spec["store_port"], spec["control_port"], spec["procs"],
               etcd=spec.get("etcd"), params=spec.get("params", {}))
    body = {**PATHS, **RANK_BODIES}[spec["path"]]
    run_threads(sl, body)
    print(RESULT + json.dumps(sl.to_json()), flush=True)


def measure(paths: list[str], sizes: list[int], *, procs: int, timeout: float,
            log: Callable[[str], None]) -> dict[str, dict[int, dict[str, Any]]]:
    """Every row of `paths` at every size: {row name: {N: figures as JSON}}; a size that failed or ran
    out of time is left out of its rows (one line says so) and the larger sizes of that path are skipped."""
    table: dict[str, dict[int, dict[str, Any]]] = {}
    selected = [row for row in rows() if row.path in paths]
    for path in dict.fromkeys(row.path for row in selected):
        for n in sizes:
            started = time.monotonic()
            try:
                phases = run_path(path, n, procs=procs, timeout=timeout)
            except (RuntimeError, OSError, AssertionError) as error:
                log(f"  {path} at N={n}: not measured ({str(error).splitlines()[0][:200]}); larger sizes skipped")
                break
            log(f"  {path} at N={n}: {time.monotonic() - started:.1f} s")
            for row in (r for r in selected if r.path == path):
                phase = phases.get(row.phase)
                if phase is None or not phase.ops:
                    continue
                table.setdefault(row.name, {})[n] = entry(row, phase, n)
    return table


def entry(row: Row, phase: Phase, n: int) -> dict[str, Any]:
    """A row's figures at `n` from its phase (collective paths: collectives and their bytes)."""
    events = row.events(phase, n)
    nbytes = phase.collective_bytes if row.unit == "collective" else phase.bytes
    ops = phase.ops
    top = max(ops, key=lambda rank: ops[rank]) if row.aggregator and ops else None
    seconds = float(phase.extra.get("seconds", max(phase.ended - phase.started, 0.0)))
    figures = scale_model.figures(ops, nbytes, seconds=seconds, events=events,
                                  aggregators=[top] if top is not None else [])
    result = figures.to_json(row.aggregator)
    result["unit"], result["path"], result["phase"] = row.unit, row.path, row.phase
    if row.unit == "collective":  # no store: what a rank moves through its collectives, and how long it took
        result["busiest_store_ops_per_s"] = None
    for key in ("verdicts", "entries"):
        if key in phase.extra:
            result[key] = phase.extra[key] if key != "verdicts" else sorted({tuple(v) for v in phase.extra[key]})
    if phase.extra.get("closed_in"):  # a rendezvous round: when the last node had its rank
        result["seconds"] = round(max(phase.extra["closed_in"]), 3)
    ranks = max(len(phase.ops), 1)
    for key in ("won_writes", "heartbeats", "heartbeat_ops", "heartbeat_bytes", "looks"):
        if key in phase.extra:
            result[f"{key}_per_rank"] = round(phase.extra[key] / ranks, 3)
    if phase.extra.get("heartbeats"):
        result["bytes_per_heartbeat"] = round(phase.extra.get("heartbeat_bytes", 0) / phase.extra["heartbeats"], 1)
    return result


# -- reporting -------------------------------------------------------------------------------------------


def report(table: dict[str, dict[int, dict[str, Any]]], sizes: list[int]) -> dict[str, Any]:
    """Print the table, the fits, the worst path and the capacity model; what --json writes."""
    print(f"{'path':44} {'N':>6} {'ops/rank':>9} {'max':>9} {'bytes/rank':>11} {'aggregator':>11} "
          f"{'store ops/s':>12} {'seconds':>8}")
    fits: dict[str, str] = {}
    for name, by_n in table.items():
        for n in sorted(by_n):
            f = by_n[n]
            aggregator = "" if f["aggregator_ops"] is None else f"{f['aggregator_ops']:.0f}"
            busiest = "-" if f["busiest_store_ops_per_s"] is None else f"{f['busiest_store_ops_per_s']:.0f}"
            print(f"{name:44} {n:>6} {f['ops_per_rank']:>9.2f} {f['max_ops_per_rank']:>9.1f} {f['bytes_per_rank']:>11.0f} "
                  f"{aggregator:>11} {busiest:>12} {f['seconds']:>8.2f}")
        fits[name] = scale_model.growth({n: f["ops_per_rank"] for n, f in by_n.items()})
    print()
    for name, shape in fits.items():
        flat = flatness(table[name])
        print(f"{name:44} per-rank operations: {shape}" + (f"; 64 -> {flat[0]}: x{flat[1]:.2f}" if flat else ""))
    worst = scale_model.worst({name: {n: f["ops_per_rank"] for n, f in by_n.items()} for name, by_n in table.items()})
    if worst is not None:
        print(f"worst path: {worst[0]} ({worst[1]} per rank)")
    return {"paths": {name: {str(n): f for n, f in by_n.items()} for name, by_n in table.items()},
            "growth": fits, "worst": None if worst is None else {"path": worst[0], "growth": worst[1]},
            "sizes": sizes}


def flatness(by_n: dict[int, dict[str, Any]]) -> tuple[int, float] | None:
    """(largest N, per-rank operations there over those at N=64), when both were measured."""
    largest = max(by_n)
    if 64 not in by_n or largest <= 64 or by_n[64]["ops_per_rank"] <= 0:
        return None
    return largest, by_n[largest]["ops_per_rank"] / by_n[64]["ops_per_rank"]


# -- the command line -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="simulated ranks, comma-separated")
    p.add_argument("--paths", default="all", help="paths to run, comma-separated (default: all)")
    p.add_argument("--procs", type=int, default=2, help="processes the ranks of a store path are spread over")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one path at one size may take")
    p.add_argument("--json", default=None, help="also write the results here (with their provenance)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.child is not None:
        return opts
    try:
        opts.size_list = sorted({int(n) for n in opts.sizes.split(",") if n.strip()})
    except ValueError:
        fail(PROG, f"--sizes takes numbers of ranks, comma-separated, not {opts.sizes!r}")
    if not opts.size_list or min(opts.size_list) < 16:
        fail(PROG, "--sizes: every size must be at least 16 (two simulated nodes of 8 ranks)")
    known = list(dict.fromkeys(row.path for row in rows()))
    opts.path_list = known if opts.paths == "all" else comma_list(opts.paths)
    unknown = [p for p in opts.path_list if p not in known]
    if unknown or not opts.path_list:
        fail(PROG, f"--paths: unknown path {unknown[0] if unknown else opts.paths!r}; the paths are {', '.join(known)}")
    if opts.procs < 1 or opts.timeout <= 0:
        fail(PROG, "--procs must be at least 1 and --timeout positive")
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    # Each TCPStore connection looks a socket's name up; where DNS does not answer, glibc waits 5 s a try,
    # every few dozen connections. One try of 1 s (children inherit it): a simulator's start, not its figures.
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    if opts.child is not None:
        child(opts.child)
        return
    started = time.monotonic()
    table = measure(opts.path_list, opts.size_list, procs=opts.procs, timeout=opts.timeout,
                    log=lambda line: print(line, file=sys.stderr, flush=True))
    results = report(table, opts.size_list)
    from scale_capacity import capacity_section
    from scale_rdzv import projection_section

    results["projected"] = projection_section(table)
    results["capacity"] = capacity_section(table)
    results["seconds"] = round(time.monotonic() - started, 1)
    if opts.json:
        from provenance import write_result

        write_result(opts.json, "scale", results)


if __name__ == "__main__":
    main()
