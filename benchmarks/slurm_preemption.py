"""Preemption on Slurm, side by side: what Slurm's warning signal costs a job.

On a real one-machine Slurm (tests/slurm_cluster.py: munged, slurmctld, nodes n1 and n2), the GPT
recipe runs as `srun python recipes/gpt.py` (deploy/slurm/gpt-tasks.sbatch: one task per worker,
world size 2, checkpoints every `--ckpt-every` steps, steps paced to `--step-seconds`), and gets
USR1 at a random step past the first checkpoint, as `#SBATCH --signal=USR1@90` sends it:

- torchrevive: every rank commits the signalled step, rank 0 requeues the job, and the requeued
  run resumes at that step (Slurm holds a requeued job about two minutes; the benchmark lets it go
  two seconds after the requeue and does not count the hold);
- stock: a script that does not handle the signal (`TORCHREVIVE_REQUEUE_SIGNAL=none`: USR1 keeps its
  default action, as in a plain DDP script with rank-0 checkpoints): the tasks die, the job fails
  and is not requeued; resubmitted by hand, it resumes from its last periodic checkpoint.

Per system it prints the median over `--runs` of: steps redone (the signalled run's last step
minus the step the next run resumed from; the ranks stop together at a vote step after the signal,
at most two votes later), seconds from the signal to the end of the signalled run, whether the job
came back by itself.

    python benchmarks/slurm_preemption.py --runs 3
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))  # its siblings, by plain name

from common import wait_until  # noqa: E402

from elastic._worker.observe.events import read_events  # noqa: E402
from tests.slurm_cluster import SlurmCluster, SlurmUnavailable  # noqa: E402

MODEL = ("--batch-size", "2", "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
         "--eval-every", "0", "--seed", "1", "--device", "cpu", "--sample-tokens", "0")
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="preemptions per system")
    p.add_argument("--ckpt-every", type=int, default=10, help="the job's periodic checkpoint interval")
    p.add_argument("--step-seconds", type=float, default=0.2, help="rank 0 paces each step to this")
    p.add_argument("--seed", type=int, default=0, help="picks the signalled steps")
    opts = p.parse_args(argv)
    if opts.runs < 1 or opts.ckpt_every < 2 or opts.step_seconds <= 0:
        p.error("--runs >= 1, --ckpt-every >= 2 and --step-seconds > 0")
    return opts


def job_info(cluster: SlurmCluster, job: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S*)", cluster.run(["scontrol", "show", "job", "-o", job])))


def steps(events: Path) -> list[dict]:
    return list(read_events(events)) if events.exists() else []


def wait(condition, timeout: float, what: str):
    value = wait_until(condition, timeout)
    if not value:
        raise SystemExit(f"slurm_preemption.py: error: timed out waiting for {what}")
    return value


def submit(cluster: SlurmCluster, ckpt: Path, signal_name: str, steps_total: int, ckpt_every: int,
           step_seconds: float) -> str:
    env = cluster.env(CKPT_DIR=str(ckpt), TORCHREVIVE_VENV=str(Path(sys.executable).parent.parent),
                      TORCHREVIVE_REQUEUE_SIGNAL=signal_name,
                      ELASTIC_FAULT=f"after_step@1+:do=slow:for={step_seconds}:restart=any")
    done = subprocess.run(
        ["sbatch", "--parsable", "-N2", "--ntasks-per-node=1", "--cpus-per-task=1", "--requeue",
         f"--output={ckpt.parent / 'job-%j.out'}", "deploy/slurm/gpt-tasks.sbatch", "--max-steps", str(steps_total),
         "--ckpt-every", str(ckpt_every), *MODEL],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )
    if done.returncode != 0:
        raise SystemExit(f"slurm_preemption.py: error: sbatch failed: {done.stderr.strip()}")
    return done.stdout.strip().split(";")[0]


def preempt_once(cluster: SlurmCluster, workdir: Path, system: str, at: int, opts: argparse.Namespace) -> dict:
    """One job, USR1 at step `at`: the steps redone by its next run and the seconds the signal took to end it."""
    ckpt = workdir / system / "ckpt"
    ckpt.parent.mkdir(parents=True)
    events = ckpt / "events.jsonl"
    total = at + 3 * opts.ckpt_every
    job = submit(cluster, ckpt, "USR1" if system == "torchrevive" else "none", total, opts.ckpt_every,
                 opts.step_seconds)
    wait(lambda: any(e["event"] == "step" and e["step"] >= at for e in steps(events)), 300, f"step {at}")
    signalled = max(e["step"] for e in steps(events) if e["event"] == "step")
    sent = time.monotonic()
    cluster.run(["scancel", "--signal=USR1", job])  # to every process of the steps, as --signal=USR1@90
    def ended_or_requeued() -> dict[str, str] | None:
        info = job_info(cluster, job)
        return info if info["JobState"] in DONE | {"PENDING"} else None

    state = wait(ended_or_requeued, 120, "the signalled run to end")
    ended = time.monotonic() - sent
    came_back = state["JobState"] == "PENDING"
    if came_back:
        time.sleep(2)  # not within the second the last run's credential was revoked
        cluster.run(["scontrol", "update", f"jobid={job}", "starttime=now"])
    else:
        job = submit(cluster, ckpt, "none", total, opts.ckpt_every, opts.step_seconds)  # resubmitted by hand
    starts = wait(lambda: [e for e in steps(events) if e["event"] == "start"][1:], 300, "the next run's start")
    cluster.run(["scancel", job])
    wait(lambda: job_info(cluster, job)["JobState"] in DONE, 120, "the job to end")
    resumed = starts[0]["step"]
    # The signalled run's last step: the ranks stop together at a vote step after the signal (at most two
    # votes later, about a second), so it may be past the step the signal came in.
    trained = max(e["step"] for e in steps(events) if e["event"] == "step" and e["time"] < starts[0]["time"])
    return {"signalled": signalled, "trained": trained, "resumed": resumed, "redone": trained - resumed,
            "seconds": ended, "came_back": came_back}


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    rng = random.Random(opts.seed)
    with tempfile.TemporaryDirectory(prefix="slurm-preemption-") as base:
        cluster = SlurmCluster(Path(base) / "slurm")
        try:
            cluster.start()
        except SlurmUnavailable as exc:
            raise SystemExit(f"slurm_preemption.py: error: {exc}") from None
        try:
            results: dict[str, list[dict]] = {"torchrevive": [], "stock": []}
            for run in range(opts.runs):
                at = opts.ckpt_every + 1 + rng.randrange(opts.ckpt_every - 1)  # past the first checkpoint
                for system in ("torchrevive", "stock"):  # the same signalled step for both
                    result = preempt_once(cluster, Path(base) / f"run{run}", system, at, opts)
                    results[system].append(result)
                    print(f"run {run} {system:11} signalled at step {result['signalled']}, last step "
                          f"{result['trained']}, next run from step {result['resumed']} ({result['redone']} redone), "
                          f"signal to end {result['seconds']:.1f} s, "
                          f"{'requeued itself' if result['came_back'] else 'failed; resubmitted by hand'}",
                          flush=True)
        finally:
            cluster.stop()
    print("\n".join(report(results, opts)))


def report(results: dict[str, list[dict]], opts: argparse.Namespace) -> list[str]:
    """The lines printed from each system's runs (`preempt_once`'s dicts): medians of the steps trained
    after the signal, the steps redone and the seconds to the end, and how many runs came back by themselves."""
    lines = [f"GPT recipe, srun python x2 on a one-machine Slurm, checkpoints every {opts.ckpt_every} steps, "
             f"steps of {opts.step_seconds:g} s, USR1 at a random step past the first checkpoint ({opts.runs} runs):"]
    for system, rows in results.items():
        after = statistics.median(r["trained"] - r["signalled"] for r in rows)
        redone = statistics.median(r["redone"] for r in rows)
        lines.append(f"  {system:11} steps after the signal median {after:g}, steps redone median {redone:g} "
                     f"(max {max(r['redone'] for r in rows)}), signal to end median "
                     f"{statistics.median(r['seconds'] for r in rows):.1f} s, came back by itself "
                     f"{sum(r['came_back'] for r in rows)}/{len(rows)}")
    return lines


if __name__ == "__main__":
    main()
