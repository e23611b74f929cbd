"""Soak: SIGKILLs at random moments under each survivors setting, and what each one cost (issue 52).

    python benchmarks/soak.py --kills 100 --json runs/soak.json                  # the figure: hours, unattended
    python benchmarks/soak.py --agents 3 --kills 50 --json runs/soak-3.json
    python benchmarks/soak.py --kills 20 --snapshot-every 1                        # a second row: every-step snapshots
    python benchmarks/soak.py --settings keep --kills 3 --size tiny --max-steps 120  # the suite's short form

The job: `--agents` agents of `python -m elastic._agent.launcher` (torchrevive-run) on this machine,
`--nnodes=1:N` (a first round's last call of 10 s), one worker each, c10d, the GPT recipe in its default settings (its own defaults for
every flag: 300 steps, a checkpoint every 50, snapshots `auto`, replica checks `auto`, an evaluation
every 100) at `--size`, under each of `--settings` (`--survivors restart|keep|train-on`). Each
incident draws a moment kind at random (benchmarks/soak_moments.py: mid-step, a checkpoint save, a
memory snapshot, a vote, a replica check, a rendezvous round or heal, a replacement's catch-up, the
first steps after a heal, a survivor that was a replacement, two kills close together on two nodes
or one), strikes once the job has been steady at its full size for a while, and waits until it is
steady again; the moment actually hit is recorded. A job holds as many incidents as its steps allow
(the last one needs `--reserve` steps), ends, and the next job takes the rest: `--kills N` incidents
per setting, each of one SIGKILL or two.

Per incident (benchmarks/soak_measure.py): the path (heal, shrink, grow, round) and restore
sources, the steps redone, the stall (the longest gap between steps, less a steady step) and the
time lost (the window until the job is steady again at its full size, less the full-size steps'
worth of samples trained in it that were not redone, times a steady step). Per job: the final
checkpoint against an uninterrupted run of the same world size (bit-identical expected under
restart, and under keep at 2 agents) and the exactly-once audit of every sample (elastic.chaos.samples).
Per setting: median, p99 and max of stall and time lost, steps redone, paths, and every incident
over the bound (a stall over 3 s, time lost over twice the median, or never steady again) with its
time line. The agents run with set-aside and crash-loop stops off (`TORCHREVIVE_SET_ASIDE_FAILURES=0`,
`TORCHREVIVE_CRASH_LOOP_ATTEMPTS=0`): the same nodes are killed again and again on purpose.
"""

from __future__ import annotations

import argparse
import random
import secrets
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings, by plain name
import soak_measure  # noqa: E402
import soak_moments  # noqa: E402
from common import comma_list  # noqa: E402
from provenance import write_result  # noqa: E402
from soak_measure import Incident  # noqa: E402

from elastic._agent.launcher.failure_policy import CRASH_LOOP_ATTEMPTS_ENV, SET_ASIDE_FAILURES_ENV  # noqa: E402
from elastic._shared.protocol.heal_env import SURVIVORS_ENV  # noqa: E402
from elastic._worker.checkpoint import read_checkpoint  # noqa: E402
from elastic.chaos.harness import ChaosJob  # noqa: E402
from elastic.chaos.job_spec import JobSpec  # noqa: E402
from elastic.chaos.samples import audit  # noqa: E402
from elastic.chaos.verdict import verified_final_checkpoint  # noqa: E402

SETTINGS = ("restart", "keep", "train-on")
SIZES = {"default": [], "tiny": ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32",
                                 "--batch-size", "8"]}
"""The recipe's default size (0.84 M parameters), and the chaos harness's tiny one (the suite's short form)."""
STALL_BOUND_S = 3.0
FIRST_ROUND_S = 10
WARM_STEPS = 15
"""Full-size steps a job trains before its first incident (its first steps are slow)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=100, help="incidents per setting (one or two SIGKILLs each)")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated: restart, keep, train-on")
    p.add_argument("--agents", type=int, default=2, help="agents of the job, one worker each (2 or more)")
    p.add_argument("--size", default="default", choices=sorted(SIZES), help="the recipe's model size")
    p.add_argument("--max-steps", type=int, default=300, help="steps of each job (the recipe's default)")
    p.add_argument("--snapshot-every", type=int, default=None,
                   help="also a second row per setting with the recipe's --snapshot-every N (1: every step)")
    p.add_argument("--kinds", default=",".join(soak_moments.KINDS), help="the moment kinds drawn from")
    p.add_argument("--reserve", type=int, default=30, help="steps a job must have left for another incident")
    p.add_argument("--reserve-s", type=float, default=15.0, help="... and seconds of steady steps")
    p.add_argument("--recovery-limit", type=float, default=120.0, help="seconds after which an incident counts "
                                                                        "as never steady again")
    p.add_argument("--recipe-arg", action="append", default=[], metavar="ARG",
                   help="one more argument of the recipe, for every job and the reference (e.g. --recipe-arg=--dropout=0)")
    p.add_argument("--stall-bound", type=float, default=STALL_BOUND_S, help="seconds of stall over which an incident "
                                                                             "is over the bound (issue 52: 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="keep the jobs' folders here (default: a temporary one)")
    p.add_argument("--json", default=None, help="write the results (and provenance) to this file")
    args = p.parse_args(argv)
    args.settings, args.kinds = comma_list(args.settings), comma_list(args.kinds)
    wrong = [s for s in args.settings if s not in SETTINGS] + [k for k in args.kinds if k not in soak_moments.KINDS]
    if wrong or not args.settings or not args.kinds or args.kills < 1 or args.agents < 2 or args.max_steps < 60:
        p.error(f"--settings takes {', '.join(SETTINGS)}; --kinds {', '.join(soak_moments.KINDS)}; --kills >= 1; "
                f"--agents >= 2; --max-steps >= 60 (not: {', '.join(wrong) or 'a count'})")
    return args


def recipe_args(args: argparse.Namespace, workdir: Path, snapshot_every: int | None) -> list[str]:
    extra = ["--snapshot-every", str(snapshot_every)] if snapshot_every is not None else []
    return ["--max-steps", str(args.max_steps), "--ckpt-dir", str(workdir / "ckpt"), *SIZES[args.size], *extra,
            *args.recipe_arg]


def start_job(setting: str, workdir: Path, args: argparse.Namespace, snapshot_every: int | None) -> ChaosJob:
    env = {SET_ASIDE_FAILURES_ENV: "0", CRASH_LOOP_ATTEMPTS_ENV: "0", SURVIVORS_ENV: setting,
           **soak_moments.fault_environment(workdir / "faults")}
    # Room for every agent (MAX) and a last call long enough for the first round to have them all (a
    # loaded machine starts an agent seconds late: a first round of one would train at half the size
    # and end other than the reference); the rounds after a failure close as soon as the live nodes
    # are back (quick rounds), and train-on may shrink to one worker (MIN).
    spec = JobSpec(workdir=workdir, agents=args.agents, nnodes=f"1:{args.agents}", max_restarts=100_000,
                   rdzv_conf=f"last_call_timeout={FIRST_ROUND_S}", run_id=unique(workdir.name), env=env, sample_log=workdir / "samples",
                   script_args=recipe_args(args, workdir, snapshot_every))
    return ChaosJob(spec).start()


def unique(name: str) -> str:
    """A run id no other job on this machine has: the keepers' shared memory is named after it (a
    second soak, or the suite's short form, beside this one must not share, or wipe, it)."""
    return f"{name}-{secrets.token_hex(3)}"


def reference_checkpoint(args: argparse.Namespace, root: Path, snapshot_every: int | None) -> Path:
    """The final checkpoint of an uninterrupted run of the same world size (run once per row)."""
    workdir = root / f"reference-{snapshot_every}"
    name, _ = verified_final_checkpoint(workdir / "ckpt", args.max_steps) if workdir.exists() else (None, None)
    if name is None:
        shutil.rmtree(workdir, ignore_errors=True)
        spec = JobSpec(workdir=workdir, agents=args.agents, nnodes=f"{args.agents}:{args.agents}", run_id=unique("reference"),
                       rdzv_conf="", script_args=recipe_args(args, workdir, snapshot_every))
        with ChaosJob(spec) as job:
            job.start()
            codes = job.wait(max(600.0, args.max_steps * 5.0))
            if codes != [0] * args.agents:
                raise RuntimeError(f"the reference run failed ({codes}):\n{job.logs()}")
        name, error = verified_final_checkpoint(workdir / "ckpt", args.max_steps)
        if name is None:
            raise RuntimeError(f"the reference run left no final checkpoint: {error}")
    return workdir / "ckpt" / name


def identical(checkpoint: Path, reference: Path) -> str | None:
    """None when the two checkpoints hold the same model and optimizer tensors bit for bit, else why not."""
    ours, theirs = read_checkpoint(checkpoint)[1], read_checkpoint(reference)[1]
    if ours.keys() != theirs.keys():
        return f"other tensors: {sorted(ours.keys() ^ theirs.keys())[:3]}"
    differ = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    return f"{len(differ)} of {len(ours)} tensors differ (first: {differ[0]})" if differ else None


def steady_since(job: ChaosJob, since: float, full: int) -> tuple[float, int] | None:
    """(steady step, newest step) once the job trained `WARM_STEPS` full-size steps after `since`."""
    records = job.records()
    fresh = [r for r in records if r["event"] == "step" and r["time"] > since and r["world_size"] == full]
    if len(fresh) < WARM_STEPS:
        return None
    d = soak_measure.steady_step(records, time.time(), full)
    return (d, fresh[-1]["step"]) if d is not None else None


def name_ranks(records: list[dict[str, Any]], kills: list[dict[str, Any]]) -> None:
    """A kill by a fault point names no rank: the agents' failure event after it does."""
    failures = sorted((r for r in records if r["event"] == "failure" and r.get("exitcode") == -9),
                      key=lambda r: r["time"])
    for kill in kills:
        if kill["rank"] is None:
            found = next((f for f in failures if f["time"] >= kill["time"] - 0.05), None)
            if found is not None:
                kill["rank"], kill["node"] = found.get("rank"), found.get("node")


def run_job(setting: str, workdir: Path, args: argparse.Namespace, rng: random.Random, snapshot_every: int | None,
            incidents: list[Incident], wanted: int, label: str) -> dict[str, Any]:
    """One job: incidents while its steps allow (up to `wanted` in all), then its end, verified."""
    shutil.rmtree(workdir, ignore_errors=True)  # (a job resumes from a checkpoint it finds)
    job = start_job(setting, workdir, args, snapshot_every)
    arms = soak_moments.Arms(workdir / "faults")
    full, heals = args.agents, setting != "restart"
    began = time.time()
    try:
        job.poll_for(lambda: True if any(r["event"] == "step" and r["world_size"] == full for r in job.records())
                     else None, 600, "a step at the full size")
        first_pids = {pid for pid, _ in soak_moments.live_workers(job).values()}
        since = 0.0
        while len(incidents) < wanted:
            try:  # (a loaded machine may take minutes for WARM_STEPS steps: the job then ends as it is)
                steady = job.poll_for(lambda s=since: steady_since(job, s, full) or (
                    False if job.last_step() >= args.max_steps - args.reserve else None), 5 * args.recovery_limit,
                    "a steady job")
            except (TimeoutError, RuntimeError) as error:
                print(f"  {label}: the job never trained steadily for another incident: {str(error).splitlines()[0]}",
                      flush=True)
                break
            if steady is False or steady[1] >= args.max_steps - max(args.reserve, args.reserve_s / steady[0]):
                break  # too few steps left for an incident to become steady again: the job ends
            d = steady[0]
            kind = rng.choice(args.kinds)
            left = max(args.reserve, args.reserve_s / d)
            kills = soak_moments.strike(job, kind, rng, arms, heals=heals, steady_s=d, first_pids=first_pids,
                                        recovered=lambda t: soak_measure.recovered_after(job.records(), t),
                                        room=lambda: job.last_step() < args.max_steps - left)
            deadline = time.monotonic() + args.recovery_limit
            while True:
                incident = soak_measure.measure(job.records(), kind=kind, kills=kills, full=full, d=d)
                if incident.recovered or time.monotonic() > deadline or job.live_agents() == 0:
                    break
                time.sleep(0.2)
            records = job.records()
            name_ranks(records, kills)
            incident.time_line = soak_measure.time_line(records, job.agent_log_times() + worker_lines(job), incident)
            incidents.append(incident)
            print(f"  {label}: {len(incidents)}/{wanted} {kind:16} " + describe(incident), flush=True)
            if not incident.recovered:
                break  # a job that never came back: the next job takes the rest
            since = incident.end or time.time()
        codes = job.wait(max(300.0, (args.max_steps - job.last_step()) * 10.0))
    finally:
        job.close()
    return verdict(job, args, codes, time.time() - began)


def verdict(job: ChaosJob, args: argparse.Namespace, codes: list[int | None], seconds: float) -> dict[str, Any]:
    """A job's end: its exit codes, its final checkpoint, the audit of its samples."""
    name, error = verified_final_checkpoint(job.spec.workdir / "ckpt", args.max_steps)
    samples = audit(job.spec.workdir / "samples")
    return {"workdir": str(job.spec.workdir), "exit_codes": codes, "seconds": seconds,
            "final_checkpoint": str(job.spec.workdir / "ckpt" / name) if name else None,
            "checkpoint_error": error, "exactly_once": samples.ok and samples.last_step == args.max_steps,
            "audit": samples.summary()}


def worker_lines(job: ChaosJob) -> list[tuple[float, str]]:
    """The runtime's own lines in the agents' logs ('torchrevive-run: ...', and the workers' warnings),
    timed by the nearest torch line before them (the workers' own stamps have whole seconds only)."""
    out: list[tuple[float, str]] = []
    stamps = job.agent_log_times()
    for index in range(len(job.agents)):
        last = 0.0
        for line in job.agent_log(index).splitlines():
            stamped = [t for t, text in stamps if text and text in line]
            if stamped:
                last = stamped[0]
            elif line.startswith("torchrevive-run:") or " WARNING [rank" in line or " ERROR [rank" in line:
                out.append((last, f"agent{index}: {line}"))
    return out


def describe(incident: Incident) -> str:
    if not incident.recovered:
        return "NOT steady again within the limit; " + ", ".join(k["hit"] for k in incident.kills)
    return (f"stall {incident.stall_s:5.2f} s, lost {incident.time_lost_s:5.2f} s, redone {incident.redone}"
            f"{'*' if incident.redone_estimated else ''}, path {'+'.join(incident.path) or '-'} "
            f"({'/'.join(incident.sources) or '-'}); {'; '.join(k['hit'] for k in incident.kills)}")


def soak_setting(setting: str, root: Path, args: argparse.Namespace, snapshot_every: int | None) -> dict[str, Any]:
    """`--kills` incidents of one setting (one row), over as many jobs as it takes."""
    rng = random.Random(f"{args.seed}-{setting}-{snapshot_every}")
    reference = reference_checkpoint(args, root, snapshot_every)
    label = f"{setting}{'' if snapshot_every is None else f' --snapshot-every {snapshot_every}'}"
    incidents: list[Incident] = []
    jobs: list[dict[str, Any]] = []
    began = time.time()
    while len(incidents) < args.kills and len(jobs) < 4 * args.kills:
        job = run_job(setting, root / f"{setting}-{snapshot_every}-job{len(jobs)}", args, rng, snapshot_every,
                      incidents, args.kills, label)
        job["identical"] = identical(Path(job["final_checkpoint"]), reference) if job["final_checkpoint"] else \
            job["checkpoint_error"]
        jobs.append(job)
        print(f"  {label}: job {len(jobs)} ended {job['exit_codes']} in {job['seconds']:.0f} s; "
              f"{job['audit']}; final checkpoint {'bit-identical' if job['identical'] is None else job['identical']}",
              flush=True)
    summary = soak_measure.summary(incidents, stall_bound=args.stall_bound)
    summary["seconds_per_incident"] = (time.time() - began) / max(1, len(incidents))
    summary["exactly_once"] = f"{sum(j['exactly_once'] for j in jobs)}/{len(jobs)}"
    summary["bit_identical"] = f"{sum(j['identical'] is None for j in jobs)}/{len(jobs)}"
    over = set(summary["over_bound"])
    return {"summary": summary, "jobs": jobs,
            "incidents": [{**i.as_dict(), "time_line": i.time_line if n in over else []} for n, i in enumerate(incidents)]}


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    print()
    print(f"soak: {args.agents} agents, {args.size} size, {args.kills} incidents per row (figures in seconds)")
    print(f"{'setting':28} {'kills':>5} {'stall med':>9} {'p99':>6} {'max':>6} {'lost med':>8} {'p99':>6} {'max':>6} "
          f"{'redone':>6} {'once':>5} {'bits':>5}  paths")
    for label, row in results.items():
        s = row["summary"]
        st, lost = s["stall_s"], s["time_lost_s"]
        redone = f"{s['redone']['mean']:.1f}" if s["redone"]["mean"] is not None else "-"
        paths = ", ".join(f"{k} {v}" for k, v in sorted(s["paths"].items(), key=lambda kv: -kv[1]))
        print(f"{label:28} {s['kills']:5d} {fmt(st['median']):>9} {fmt(st['p99']):>6} {fmt(st['max']):>6} "
              f"{fmt(lost['median']):>8} {fmt(lost['p99']):>6} {fmt(lost['max']):>6} {redone:>6} "
              f"{s['exactly_once']:>5} {s['bit_identical']:>5}  {paths}")
    for label, row in results.items():
        print(f"{label}: {row['summary']['seconds_per_incident']:.1f} s per incident; "
              f"{len(row['summary']['over_bound'])} over the bound (stall > {args.stall_bound:g} s, time lost > 2x median, "
              "or never steady again)")
        for n in row["summary"]["over_bound"]:
            incident = row["incidents"][n]
            print(f"  incident {n + 1} ({incident['kind']}): stall {fmt(incident['stall_s'])} s, lost "
                  f"{fmt(incident['time_lost_s'])} s")
            for line in incident["time_line"]:
                print(f"    {line}")


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Stopped from outside (kill, a batch system's time limit): close the jobs first (their agents and
    # workers, their shared memory), as on Ctrl-C; the rows already measured are in --json.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows = [None] if args.snapshot_every is None else [None, args.snapshot_every]
    results: dict[str, dict[str, Any]] = {}
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="soak-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        for setting in args.settings:
            for snapshot_every in rows:
                label = setting if snapshot_every is None else f"{setting} (--snapshot-every {snapshot_every})"
                print(f"{label}: {args.kills} incidents, {args.agents} agents, {args.size} size", flush=True)
                results[label] = soak_setting(setting, root, args, snapshot_every)
                if args.json:  # after every row: a long soak stopped midway keeps the rows it measured
                    write_result(args.json, "soak", {"agents": args.agents, "size": args.size, "kills": args.kills,
                                                     "max_steps": args.max_steps, "kinds": args.kinds, "rows": results})
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    report(results, args)
    bad = [label for label, row in results.items() if row["summary"]["unrecovered"]
           or row["summary"]["exactly_once"].split("/")[0] != row["summary"]["exactly_once"].split("/")[1]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
