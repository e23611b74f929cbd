"""Warm against cold worker starts: the same job's step time with 2 workers on one node, side by side.

    python benchmarks/warm_cold.py                  # or: python benchmarks/overhead.py --warm-vs-cold
    python benchmarks/warm_cold.py --rounds 6 --json runs/warm_cold.json

`torchrevive-run` forks its workers from a fork server that imported torch (warm); with
`--preload ''` it starts them as torchrun does, `python -u script.py` (cold). A warm worker
must train exactly as fast as a cold one: what it takes from its start (thread pools sized
from its environment, torchrun's `OMP_NUM_THREADS=1` with several workers a node) is the
cold one's (elastic/_agent/launcher/warm_env.py). Target: cold step / warm step in [0.97, 1.03].

Design: each round starts the same job twice at once, warm and cold (which one first
alternates), so both see the same machine: on a shared one its speed wanders by tens of
per cent within seconds, which jobs run one after the other would read as a difference.
A job is `recipes/gpt.py` (its default size unless told) under `torchrevive-run
--standalone --nproc-per-node=2`, with the user's environment and no OMP_NUM_THREADS of
the benchmark's own (`--omp N` exports one), so torchrun's default applies as it does for
a user. Each job's speed is read from rank 0's event log over the window in which both
jobs were past their first `--skip` steps and neither had ended: the start (warm or cold),
the first steps, and a job running alone at the end are not counted. Each round's ratio is
cold step / warm step over that window; the figure is their geometric mean with a 95 %
t-interval over the rounds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings, also when loaded by path

from provenance import REPO, write_result  # noqa: E402

RECIPE = REPO / "recipes" / "gpt.py"
KINDS = ("warm", "cold")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4, help="rounds of one warm and one cold job (ABBA order)")
    p.add_argument("--steps", type=int, default=60, help="steps of each job")
    p.add_argument("--skip", type=int, default=10, help="first steps not timed (the start, warm-up)")
    p.add_argument("--nproc", type=int, default=2, help="workers on the node")
    p.add_argument("--omp", default=None, help="export OMP_NUM_THREADS=N to both (default: unset, torchrun's default)")
    p.add_argument("--recipe-args", default="", help="more flags for the recipe, e.g. '--n-embd 64'")
    p.add_argument("--json", default=None, help="write the figures here (benchmarks/provenance.py)")
    opts = p.parse_args(argv)
    if opts.rounds < 1 or opts.steps <= opts.skip + 1 or opts.skip < 1 or opts.nproc < 2:
        p.error("need --rounds >= 1, --skip >= 1, --steps > --skip + 1 and --nproc >= 2 (several workers a node)")
    return opts


def job_command(opts: argparse.Namespace, kind: str, events: Path) -> list[str]:
    launcher = [sys.executable, "-m", "elastic._agent.launcher", "--standalone", f"--nproc-per-node={opts.nproc}"]
    if kind == "cold":
        launcher.append("--preload=")
    recipe = [str(RECIPE), "--max-steps", str(opts.steps), "--events", str(events), "--sample-tokens", "0",
              "--eval-every", "0", *opts.recipe_args.split()]
    return [*launcher, *recipe]


def step_times(events: Path) -> dict[int, float]:
    """Each step's end (seconds since the epoch) from rank 0's event log."""
    times = {}
    for line in events.read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "step":
            times[int(record["step"])] = float(record["time"])
    return times


def window_step_seconds(jobs: dict[str, dict[int, float]], skip: int) -> dict[str, float]:
    """Each job's seconds a step over the window both ran in steady state (see the module docstring)."""
    begin = max(times[skip] for times in jobs.values())
    end = min(times[max(times)] for times in jobs.values())
    seconds = {}
    for kind, times in jobs.items():
        inside = sorted(t for step, t in times.items() if step >= skip and begin <= t <= end)
        if len(inside) < 3:
            raise RuntimeError(f"the {kind} job completed {len(inside)} steps in the common window: run more --steps")
        seconds[kind] = (inside[-1] - inside[0]) / (len(inside) - 1)
    return seconds


def run_round(opts: argparse.Namespace, workdir: Path, index: int) -> dict[str, float]:
    """Both jobs at once (see the module docstring); each one's seconds a step."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if opts.omp is not None:
        env["OMP_NUM_THREADS"] = opts.omp
    env.setdefault("LOGLEVEL", "WARNING")
    order = KINDS if index % 2 == 0 else tuple(reversed(KINDS))
    events = {kind: workdir / f"{kind}{index}.jsonl" for kind in KINDS}
    logs = {kind: (workdir / f"{kind}{index}.log").open("w") for kind in KINDS}
    jobs = {kind: subprocess.Popen(job_command(opts, kind, events[kind]), env=env, cwd=REPO, stdout=logs[kind],
                                   stderr=subprocess.STDOUT) for kind in order}
    try:
        for kind, job in jobs.items():
            if job.wait(timeout=1800) != 0:
                raise RuntimeError(f"the {kind} job failed (exit {job.returncode}):\n"
                                   f"{(workdir / f'{kind}{index}.log').read_text()[-3000:]}")
    finally:
        for kind, job in jobs.items():
            if job.poll() is None:
                job.kill()
                job.wait()
            logs[kind].close()
    times = {kind: step_times(events[kind]) for kind in KINDS}
    for kind in KINDS:
        if opts.skip not in times[kind]:
            raise RuntimeError(f"the {kind} job logged no step {opts.skip}")
    return window_step_seconds(times, opts.skip)


def interval(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of `ratios` and its 95 % t-interval (the interval is the mean's with one round)."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), math.exp(mean), math.exp(mean)
    from statistics import NormalDist

    # Student's t quantile by the Cornish-Fisher expansion (good to 3 digits from 3 degrees of freedom).
    df, z = len(logs) - 1, NormalDist().inv_cdf(0.975)
    t = z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    seconds: dict[str, list[float]] = {kind: [] for kind in KINDS}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="warm-cold-") as tmp:
        for index in range(opts.rounds):
            measured = run_round(opts, Path(tmp), index)
            for kind in KINDS:
                seconds[kind].append(measured[kind])
            print(f"round {index}: warm {measured['warm'] * 1e3:.1f}, cold {measured['cold'] * 1e3:.1f} ms a step",
                  flush=True)
    ratios = [cold / warm for warm, cold in zip(seconds["warm"], seconds["cold"])]
    ratio, low, high = interval(ratios)
    print(f"\n{opts.nproc} workers on one node, each job; warm and cold at once; recipes/gpt.py, {opts.steps} steps a job ({opts.skip} untimed), "
          f"OMP_NUM_THREADS {'=' + opts.omp if opts.omp else 'unset (torchrun: 1)'}; {time.monotonic() - started:.0f} s")
    print("| round | warm ms/step | cold ms/step | cold / warm |\n|---:|---:|---:|---:|")
    for index, (warm, cold) in enumerate(zip(seconds["warm"], seconds["cold"])):
        print(f"| {index} | {warm * 1e3:.1f} | {cold * 1e3:.1f} | {cold / warm:.3f} |")
    within = 0.97 <= ratio <= 1.03
    print(f"step ratio cold / warm: {ratio:.3f} (95 % CI {low:.3f}-{high:.3f}); target [0.97, 1.03]: "
          f"{'met' if within else 'NOT met'}")
    if opts.json:
        write_result(opts.json, "warm_cold", {
            "nproc_per_node": opts.nproc, "steps": opts.steps, "skip": opts.skip, "omp_num_threads": opts.omp,
            "warm_step_seconds": seconds["warm"], "cold_step_seconds": seconds["cold"],
            "ratio_cold_over_warm": ratio, "ci95": [low, high], "target": [0.97, 1.03], "met": within,
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
