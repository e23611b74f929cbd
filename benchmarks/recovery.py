"""Recovery after a SIGKILLed worker at three model sizes: plain torchrun (stock, tuned) versus ours, side by side.

    python benchmarks/recovery.py --settings ours,ours-keep,ours-train-on --goodput-seconds 0   # the README's row
    python benchmarks/recovery.py --sizes default --kills 3 --settings ours,ours-disk
    python benchmarks/recovery.py        # every setting at every size, 5 kills each, then goodput: hours on 2 cores

The job: two torchrun agents on this machine, `--nnodes=1:3 --nproc-per-node=1`,
c10d rendezvous, the GPT recipe on its default data (the stdlib's sources) at
each of `--sizes`: `default` (the recipe as a user runs it: 4 layers, width
128, block 128, batch 16, 0.84 M parameters, about 4 steps/s on 2 cores),
`tiny` (2 layers, width 64, block 32, batch 8: about 40 steps/s, the size the
README's figures were measured at before) and `large` (8 layers, width 512,
block 64, batch 4: 25 M parameters, 300 MB of state per rank), checkpoints
every `--ckpt-every` steps (50, the recipe's default, so that what a kill costs
in steps is the cost at a realistic checkpoint interval). Every setting runs the
same job at every size. One worker of a random rank is SIGKILLed, `--kills`
times, each once the job has trained `--settle` seconds after the previous
recovery.

What a kill costs is its time lost (benchmarks/soak_measure.py, as the soak
measures it): from the last step before the kill until the job trains steadily
at its full size again, past the newest step it had completed, less the
full-size steps' worth of samples trained meanwhile that were not redone, times
a steady step (the median before the kill): redone steps, slow first steps,
steps at a smaller world size and a join's pause all count. Beside it: the
stall (the longest gap between two steps, less a steady step), kill to the next
step, and the time line (`kill_time_line`): detected (an agent noticed), the
restore began and ended, the first step, and that first step's own duration.

- stock: `torchrun` as installed, its defaults (one worker store shared by
  every round, 30 s last call, 5 s keep-alive); the runtime builds each round's
  process group on a namespace of that store no earlier round used
  (`elastic._worker.runtime.round_store`), so stale addresses cost no rounds.
- tuned: plain `torchrun` with what the runtime's hint names,
  `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (a store per round: with the shared
  one a node that joins after the first round times the rendezvous out) and
  `--rdzv-conf` of a 2 s last call and 1 s keep-alive: what a user who keeps
  torchrun gets; it still starts every worker cold.
- ours: `python -m elastic._agent.launcher` (fresh store per round, 2 s last call, 1 s
  keep-alive, warm worker starts, a snapshot keeper per agent), the recipe in its
  default settings (in-memory snapshots at the auto interval), the same flags
  otherwise; ours-every-step is ours with `--snapshot-every 1` (a kill redoes at
  most one step), a row of its own, never the headline.
- ours-torch-rounds: ours with torch's rounds (`--rdzv-conf quick_rounds=0`):
  every round waits its 2 s last call and nodes poll the state once a second,
  as before `elastic._agent.rendezvous.quick_rounds`.
- ours-keep, ours-train-on: ours with `TORCHREVIVE_SURVIVORS=keep` (the survivors keep their
  processes and wait for the replacement) or `train-on` (they train on at the smaller size, and the
  replacement joins at a later vote step; its join's pause is also a column of its own).
- ours-disk: ours without the memory tier (`TORCHREVIVE_SNAPSHOTS=0`, so no
  keeper, and `--snapshot-every 0`): a kill resumes from the newest checkpoint
  on disk, as before the snapshots. stock and tuned have no keeper either
  (plain torchrun), so they restore from disk too.

Per size and setting it prints the time lost, the stall and the recovery time (kill -> first
completed step after the restarted group's start), the median time line, failed
rendezvous rounds (rounds beyond one per kill), restarts consumed (failures
the agents counted against `--max-restarts`), and goodput with one kill every
`--goodput-interval` seconds for `--goodput-seconds`: the samples the job trained
on (each step counts its world size's worth: a job that trains on at a smaller
size trains fewer per step) divided by those a fault-free run of the same setting
trains in that time.
A second table gives, per setting, the steps paused per kill (the median recovery time times the
step rate before the kill), the bytes the restore read from disk (0 from memory), the steps redone
per kill (steps finished before the kill that the job trained again), mean and max, from
the `redone` field of the restore event that followed each kill; where the
runtime cannot know it (no keeper: ours-disk, stock, tuned) from the event log
instead, marked `*`: the newest step logged before the kill less the restored
step (a step's event is written one step late, so this can be one short). It
also says where each restore came from (the restore event's `source`: memory,
peer or disk; none: no checkpoint yet, the job started over), and the
fault-free run's steps/s (what snapshots every step cost in throughput).
Targets at the default size, 2 agents, idle machine (issue 52): a median time
lost of at most 1.5 s (ours), 1.0 s (ours-keep), 0.8 s (ours-train-on); zero
failed rounds for every setting; goodput >= 0.90. benchmarks/soak.py kills at random moments.

Each job's picture (`python -m elastic.report`: loss, throughput, world size, recoveries) goes to `--pictures`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings, by plain name
import soak_measure  # noqa: E402
from common import comma_list, median, wait_until  # noqa: E402
from provenance import write_result  # noqa: E402

from elastic._agent.launcher.failure_policy import SET_ASIDE_FAILURES_ENV
from elastic._agent.launcher.launch import SNAPSHOTS_ENV
from elastic._shared.protocol.heal_env import SURVIVORS_ENV
from elastic._shared.protocol.recovery_defaults import FRESH_STORE_ENV, merged_rdzv_conf
from elastic.chaos.harness import ChaosJob
from elastic.chaos.job_spec import JobSpec
from elastic.chaos.verdict import draw_report

REPO = Path(__file__).resolve().parent.parent
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--batch-size", "8"]
SIZES = {
    "default": [],  # the GPT recipe as a user runs it: 4 layers, width 128, block 128, batch 16 (0.84 M parameters)
    "tiny": TINY,  # 0.1 M parameters, about 40 steps/s on 2 cores: what the README's figures used to be
    "large": ["--n-layer", "8", "--n-head", "8", "--n-embd", "512", "--block-size", "64", "--batch-size", "4"],  # 25 M
}
"""Model sizes the benchmark runs at (the recipe's flags); `--sizes` picks."""
SETTINGS = ("stock", "ours", "tuned", "ours-disk", "ours-torch-rounds", "ours-keep", "ours-train-on", "ours-every-step")
OURS = SETTINGS[1:2] + SETTINGS[3:]  # python -m elastic._agent.launcher


PHASES = ("detected", "restore_began", "restored", "step", "first_step_s", "steady_step_s")
"""The time line of a kill (`kill_time_line`), in the order its marks follow each other."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=5, help="SIGKILLs per setting (>= 5 for the README figures)")
    p.add_argument("--settle", type=float, default=5.0, help="seconds of training between a recovery and the next kill")
    p.add_argument("--recovery-limit", type=float, default=400.0, help="seconds after which a recovery counts as failed")
    p.add_argument("--goodput-seconds", type=float, default=180.0, help="length of the goodput runs (0: skip)")
    p.add_argument("--goodput-interval", type=float, default=60.0, help="seconds between kills in the goodput runs")
    p.add_argument("--settings", default=",".join(SETTINGS), help="which to run, comma-separated")
    p.add_argument("--sizes", default=",".join(SIZES), help=f"model sizes, comma-separated, each with every setting: "
                                                            f"{', '.join(SIZES)}")
    p.add_argument("--ckpt-every", type=int, default=50, help="the job's steps between checkpoints on disk")
    p.add_argument("--agents", type=int, default=2, help="agents of the job (one worker each), 2 or more")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pictures", default="runs/recovery-benchmark", help="folder for each job's report PNG")
    p.add_argument("--json", default=None, help="write the results (and provenance) to this file (benchmarks/provenance.py)")
    return p.parse_args(argv)


def start_job(setting: str, workdir: Path, ckpt_every: int, steps: int = 10_000_000,
              agents: int = 2, model: list[str] = TINY) -> ChaosJob:
    """Two agents of one long job; `stock` is torchrun with torch's defaults throughout,
    `tuned` plain torchrun with a store per round and our launcher's `--rdzv-conf`,
    `ours-disk` our launcher without its snapshot keeper."""
    env = {FRESH_STORE_ENV: "1"} if setting == "tuned" else {}
    if setting in OURS:  # the same nodes are killed again and again on purpose: not a bad node to set aside
        env[SET_ASIDE_FAILURES_ENV] = "0"
    snapshots = ["--snapshot-every", "1"] if setting == "ours-every-step" else []  # else the default: auto
    if setting == "ours-disk":
        env[SNAPSHOTS_ENV] = "0"
        snapshots = ["--snapshot-every", "0"]
    if setting in ("ours-keep", "ours-train-on"):
        env[SURVIVORS_ENV] = setting.removeprefix("ours-")
    rdzv_conf = {"tuned": merged_rdzv_conf(""), "ours-torch-rounds": "quick_rounds=0"}.get(setting, "")
    spec = JobSpec(
        workdir=workdir, launcher="ours" if setting in OURS else "stock", max_restarts=100, agents=agents,
        nnodes=f"1:{agents + 1}", rdzv_conf=rdzv_conf, run_id=workdir.name, env=env,
        script_args=["--max-steps", str(steps), "--eval-every", "0",  # the recipe's default data (the stdlib)
                     "--ckpt-dir", str(workdir / "ckpt"), "--ckpt-every", str(ckpt_every), "--log-every", "1000",
                     *snapshots, *model],
    )
    return ChaosJob(spec).start()


def restarts_consumed(job: ChaosJob) -> list[int]:
    """Failures each agent counted: torchrun logs 'N/M attempts left' once per restart."""
    return [len(re.findall(r"\d+/100 attempts left", job.agent_log(i))) for i in range(len(job.agents))]


def wait_for_all_workers(job: ChaosJob, timeout: float = 300) -> None:
    """An agent may join a round after others started without it: measure from the full world."""
    full = job.spec.agents
    if not wait_until(lambda: any(r["event"] == "step" and r["world_size"] == full for r in job.records()), timeout):
        raise RuntimeError(f"the {full} agents never trained together:\n{job.logs()}")


def step_rate(job: ChaosJob, before: float, window: float = 3.0) -> float:
    """Steps per second the job made in the `window` seconds before time `before`."""
    steps = [r["step"] for r in job.records() if r["event"] == "step" and before - window <= r["time"] <= before]
    return (max(steps) - min(steps)) / window if len(steps) > 1 else 0.0


def rounds_completed(job: ChaosJob) -> int:
    return len(re.findall(r"Rendezvous complete for workers", job.agent_log(0)))


def steps_redone(job: ChaosJob, killed_at: float, recovered_at: float) -> dict:
    """What the kill at `killed_at` cost in steps: the restore that followed it (before the
    restarted group's first step, at `recovered_at`): `redone` from its event when the runtime
    gives it, else from the event log (`estimated`), and its `source` ("none": no checkpoint yet)."""
    records = job.records()
    before = max((r["step"] for r in records if r["event"] == "step" and r["time"] <= killed_at), default=0)
    restores = [r for r in records if r["event"] == "restore" and killed_at < r["time"] <= recovered_at]
    if not restores:  # no checkpoint yet: the job started over from step 0
        return {"redone": before, "estimated": True, "source": "none", "restored_step": 0, "before": before,
                "disk_bytes": 0}
    first = restores[0]
    disk_bytes = int(first.get("bytes_read", 0)) if first.get("source", "disk") == "disk" else 0
    if "redone" in first:
        return {"redone": int(first["redone"]), "estimated": False, "source": first.get("source", "disk"),
                "restored_step": first["step"], "before": before, "disk_bytes": disk_bytes}
    return {"redone": max(0, before - first["step"]), "estimated": True, "source": first.get("source", "disk"),
            "restored_step": first["step"], "before": before, "disk_bytes": disk_bytes}


def kill_time_line(records: list[dict], agent_lines: list[tuple[float, str]], killed_at: float) -> dict[str, float] | None:
    """Where one kill's time went, in seconds after the kill (None before the job trained again):

    - `detected`: the first failure an agent noticed (its `failure` event, or torch's "will restart
      worker group" line), when it logged one;
    - `restore_began` and `restored`: the restore that followed (a restart's from a snapshot or the
      disk, a heal's from a live peer): its event's time less its seconds, and its time;
    - `step`: the first step the group completed after it, and `first_step_s`: that step's own
      duration (from `restored`), against `steady_step_s`, the median step before the kill. A step
      the killed rank 0 completed but never logged (its lines go out one step late) counts as ended
      a steady step after the last one logged (the restore says how far the job had come).
    The stall and the time lost are soak_measure's (`measure_recovery`).
    """
    steps = sorted((r for r in records if r["event"] == "step"), key=lambda r: r["time"])
    before = [r for r in steps if r["time"] <= killed_at]
    recent = before[-11:]
    gaps = [b["time"] - a["time"] for a, b in zip(recent, recent[1:]) if b["step"] == a["step"] + 1]
    resumed, first = None, None
    for r in records:  # as ChaosJob.recovery_seconds: the first step of a group started or healed after the kill
        if r["time"] <= killed_at:
            continue
        if r["event"] in ("start", "heal"):
            resumed = r["step"]
        elif r["event"] == "step" and resumed is not None and r["step"] > resumed:
            first = r
            break
    if first is None or not before or not gaps:
        return None
    steady = statistics.median(gaps)
    restore = next((r for r in records if r["event"] == "restore" and killed_at < r["time"] <= first["time"]), None)
    newest = before[-1]["step"]
    if restore is not None and "redone" in restore:
        newest = max(newest, restore["step"] + int(restore["redone"]))
    last_end = before[-1]["time"] + (newest - before[-1]["step"]) * steady
    line = {"steady_step_s": steady}
    noticed = [r["time"] for r in records if r["event"] == "failure" and killed_at < r["time"] <= first["time"]]
    noticed += [t for t, what in agent_lines if killed_at < t <= first["time"] and "will restart worker group" in what]
    if noticed:
        line["detected"] = min(noticed) - killed_at
    if restore is not None:
        line["restore_began"] = restore["time"] - float(restore.get("seconds", 0.0)) - killed_at
        line["restored"] = restore["time"] - killed_at
    line["step"] = first["time"] - killed_at
    line["first_step_s"] = first["time"] - (restore["time"] if restore is not None else last_end)
    return line


def steady_again(job: ChaosJob, killed_at: float, limit: float, line: dict | None) -> soak_measure.Incident | None:
    """The kill's stall and time lost (soak_measure), once the job trains steadily at its full size again."""
    if line is None:
        return None
    kill = [{"time": killed_at, "rank": None, "node": None, "hit": "mid_step"}]
    found = wait_until(lambda: (lambda i: i if i.recovered else None)(soak_measure.measure(
        job.records(), kind="mid_step", kills=kill, full=job.spec.agents, d=line["steady_step_s"])), limit, 0.2)
    return found


def picture(job: ChaosJob, args: argparse.Namespace, title: str) -> None:
    out = draw_report(job.events_path, Path(args.pictures) / f"{job.spec.workdir.name}.png", title=title)
    if out is not None:
        print(f"  picture: {out}", flush=True)


def measure_recovery(setting: str, size: str, workdir: Path, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    job = start_job(setting, workdir, args.ckpt_every, agents=args.agents, model=SIZES[size])
    times: list[float] = []
    redone: list[dict] = []
    phases: list[dict[str, float]] = []
    paused: list[float] = []
    joins: list[float] = []
    costs: list[soak_measure.Incident] = []
    failures = 0
    failed_rounds = 0
    try:
        wait_for_all_workers(job)
        for _ in range(args.kills):
            time.sleep(args.settle)
            rounds_before = rounds_completed(job)  # (the second agent may have joined in a round of its own)
            job.signal_worker(signal.SIGKILL, rng=rng)
            killed_at = job.faults[-1][1]
            rate = step_rate(job, killed_at)
            back = wait_until(lambda t=killed_at: job.recovery_seconds(t), args.recovery_limit, interval=0.1)
            if back is None:
                failures += 1
                times.append(args.recovery_limit)
            else:
                times.append(back)
            paused.append(times[-1] * rate)  # the steps the job would have made in the time it stood still
            failed_rounds += max(0, rounds_completed(job) - rounds_before - 1)  # one round per kill is the price
            breakdown = kill_time_line(job.records(), job.agent_log_times(), killed_at) if back is not None else None
            if breakdown:
                phases.append(breakdown)
            where = ", ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in (breakdown or {}).items())
            lost = ""
            if back is not None:
                redone.append(steps_redone(job, killed_at, killed_at + back))
                r = redone[-1]
                lost = (f"; restored step {r['restored_step']} from {r['source']}, "
                        f"{r['redone']}{'*' if r['estimated'] else ''} steps redone (newest step logged before the "
                        f"kill: {r['before']})")
            incident = steady_again(job, killed_at, args.recovery_limit, breakdown)  # train-on: grown back too
            if incident is not None:
                costs.append(incident)
                lost += f"; stall {incident.stall_s:.2f} s, time lost {incident.time_lost_s:.2f} s"
                joins += [r["seconds"] for r in job.records() if r["event"] == "heal" and r.get("change") == "grow"
                          and incident.begin < r["time"] <= incident.end]
            print(f"  {size} {setting}: kill {len(times)}: recovered in {times[-1]:.2f} s ({where or 'no breakdown'}){lost}",
                  flush=True)
    finally:
        job.close()
    picture(job, args, f"{setting}, {size} model: {args.kills} SIGKILLs")
    stalls, lost = [c.stall_s for c in costs], [c.time_lost_s for c in costs]
    return {
        "stall_s": stalls, "time_lost_s": lost,
        "stall_median_s": median(stalls, math.nan),
        "lost_median_s": median(lost, math.nan), "lost_worst_s": max(lost, default=math.nan),
        "recovery_s": times,
        "median_s": statistics.median(times),
        "worst_s": max(times),
        "unrecovered": failures,
        "failed_rounds": failed_rounds,
        "restarts_consumed": restarts_consumed(job),
        "median_phases_s": {k: statistics.median(p[k] for p in phases if k in p) for k in PHASES
                            if any(k in p for p in phases)},
        "redone": [r["redone"] for r in redone],
        "redone_estimated": any(r["estimated"] for r in redone),
        "restore_sources": [r["source"] for r in redone],
        "steps_paused": paused,
        "disk_bytes": [r["disk_bytes"] for r in redone],
        "join_pause_s": joins,
    }


def measure_goodput(setting: str, size: str, workdir: Path, args: argparse.Namespace, faults: bool) -> float:
    """Samples per second of wall time the job keeps, from its first step at full size on (a step
    counts as many per-rank batches as its world size: the batch size is the same for every setting)."""
    rng = random.Random(args.seed + 1)
    job = start_job(setting, workdir, args.ckpt_every, agents=args.agents, model=SIZES[size])
    try:
        wait_for_all_workers(job)
        first = next(r for r in job.records() if r["event"] == "step" and r["world_size"] == args.agents)
        started = first["time"]
        end = started + args.goodput_seconds
        next_kill = started + args.goodput_interval
        while time.time() < end:
            if faults and time.time() >= next_kill:
                job.signal_worker(signal.SIGKILL, rng=rng)
                next_kill += args.goodput_interval
            time.sleep(0.1)
        kept = kept_steps(job.records(), after=first["step"], until=end)
    finally:
        job.close()
    picture(job, args, f"{setting}: goodput run, {f'one kill per {args.goodput_interval:g} s' if faults else 'no faults'}")
    return sum(kept.values()) / args.goodput_seconds


def kept_steps(records: list[dict], *, after: int, until: float) -> dict[int, int]:
    """Step -> world size of the steps past `after` the job kept by time `until`: a step trained again
    after a restore counts once, at the size it was last trained at (the one whose result stands)."""
    kept: dict[int, int] = {}
    for r in records:
        if r["event"] == "step" and after < r["step"] and r["time"] <= until:
            kept[r["step"]] = r["world_size"]
    reached = max(kept, default=after)
    return {step: size for step, size in kept.items() if step <= reached}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings, sizes = comma_list(args.settings), comma_list(args.sizes)
    if set(settings) - set(SETTINGS) or set(sizes) - set(SIZES) or not sizes or args.kills < 1 or args.agents < 2:
        print(f"recovery.py: error: --settings takes {', '.join(SETTINGS)}; --sizes {', '.join(SIZES)}; "
              "--kills >= 1; --agents >= 2", file=sys.stderr)
        return 2
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="recovery-bench-") as tmp:
        root = Path(tmp)
        for size in sizes:
            results[size] = {}
            for setting in settings:
                print(f"{size} model, {setting}: {args.kills} kills", flush=True)
                r = results[size][setting] = measure_recovery(setting, size, root / f"{size}-{setting}-recovery", args)
                if args.goodput_seconds > 0:
                    clean = measure_goodput(setting, size, root / f"{size}-{setting}-clean", args, faults=False)
                    faulty = measure_goodput(setting, size, root / f"{size}-{setting}-faulty", args, faults=True)
                    r["goodput"] = faulty / clean
                    r["steps_per_s_clean"] = clean
    report(results, args)
    if args.json:
        write_result(args.json, "recovery", {"agents": args.agents, "kills": args.kills, "ckpt_every": args.ckpt_every,
                                             "goodput_interval_s": args.goodput_interval, "sizes": results})
        print(f"results: {args.json}")
    return 0


def report(results: dict[str, dict[str, dict]], args: argparse.Namespace) -> None:
    """Per model size (`results[size][setting]`: `measure_recovery`'s dicts, with `goodput` and
    `steps_per_s_clean` when the goodput runs ran): the tables, the time lines and the ratios of every
    setting measured, the sizes side by side; then all of it as JSON."""
    print()
    print(f"{'size':8} {'setting':17} {'lost s':>7} {'worst':>6} {'stall s':>8} {'kill-step s':>11} {'worst':>6} "
          f"{'failed rounds':>13} {'restarts used':>13} {'goodput':>8}")
    for size, by_setting in results.items():
        for setting, r in by_setting.items():
            goodput = f"{r['goodput']:.2f}" if "goodput" in r else "-"
            print(f"{size:8} {setting:17} {r['lost_median_s']:7.2f} {r['lost_worst_s']:6.2f} {r['stall_median_s']:8.2f} {r['median_s']:11.2f} "
                  f"{r['worst_s']:6.2f} {r['failed_rounds']:13d} {'/'.join(map(str, r['restarts_consumed'])):>13} "
                  f"{goodput:>8}")
    print()
    print(f"checkpoint every {args.ckpt_every} steps; steps redone per kill "
          "(* from the event log: the runtime has no figure without a keeper)")
    print(f"{'size':8} {'setting':17} {'redone mean':>12} {'redone max':>11} {'paused':>7} {'join s':>7} "
          f"{'disk MB':>8} {'steps/s':>8}  restored from")
    for size, by_setting in results.items():
        for setting, r in by_setting.items():
            mark = "*" if r["redone_estimated"] else ""
            mean = f"{statistics.fmean(r['redone']):.1f}{mark}" if r["redone"] else "-"
            worst = f"{max(r['redone'])}{mark}" if r["redone"] else "-"
            rate = f"{r['steps_per_s_clean']:.1f}" if "steps_per_s_clean" in r else "-"
            sources = ", ".join(f"{s} {r['restore_sources'].count(s)}" for s in dict.fromkeys(r["restore_sources"])) or "-"
            paused = f"{statistics.median(r['steps_paused']):.1f}" if r["steps_paused"] else "-"
            disk = f"{statistics.fmean(r['disk_bytes']) / 1e6:.1f}" if r["disk_bytes"] else "-"
            join = f"{statistics.median(r['join_pause_s']):.2f}" if r.get("join_pause_s") else "-"
            print(f"{size:8} {setting:17} {mean:>12} {worst:>11} {paused:>7} {join:>7} {disk:>8} {rate:>8}  {sources}")
    for size, by_setting in results.items():
        for setting, r in by_setting.items():
            line = r["median_phases_s"]
            marks = ", ".join(f"{k.replace('_', ' ')} at {line[k]:.2f} s" for k in PHASES[:4] if k in line)
            if marks:
                print(f"{size} {setting}: median time line after a kill: {marks}; the first step took "
                      f"{line['first_step_s']:.2f} s, a steady one {line['steady_step_s']:.2f} s")
    for size, by_setting in results.items():
        for other in ("stock", "tuned", "ours-disk", "ours-torch-rounds", "ours"):
            for fast in ("ours-train-on", "ours-keep", "ours"):
                if other != fast and {other, fast} <= by_setting.keys():
                    print(f"{size}: median time lost, {other} / {fast}: "
                          f"{ratio(by_setting[other]['lost_median_s'], by_setting[fast]['lost_median_s'])}")
        if {"ours", "ours-disk"} <= by_setting.keys() and "goodput" in by_setting["ours"]:
            print(f"{size}: goodput (one kill per {args.goodput_interval:g} s), ours / ours-disk: "
                  f"{by_setting['ours']['goodput']:.2f} / {by_setting['ours-disk']['goodput']:.2f}")
    print(json.dumps(results))


def ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}x" if b > 0 else "-"


if __name__ == "__main__":
    sys.exit(main())
