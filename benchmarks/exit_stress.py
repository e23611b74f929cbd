"""Clean exits under load: the shortest real job, run many times, must never abort at exit.

    python benchmarks/exit_stress.py                      # 50 runs, two at a time, one CPU burner
    python benchmarks/exit_stress.py --runs 10 --burners 2

Each run is `torchrun --standalone --nproc-per-node=2` of the GPT recipe with a
tiny model on CPU (gloo): a few steps, a checkpoint every other step, a final
commit, then the exit. A worker still running a library thread inside torch's
C++ code while the interpreter finalizes dies with SIGABRT ("terminate called
without an active exception", exit -6), which torchrun reads as a failure and
answers with a restart: a finished job counted as a crash. Runs go `--parallel`
at a time beside `--burners` processes spinning on the CPU, so threads are
descheduled at the worst moments. It prints one line per bad run and ends
with "N runs, M aborts, K other failures"; exit status 1 when M or K is not 0.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPT_RECIPE = REPO / "recipes" / "gpt.py"
TINY_GPT = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "4"]
CORPUS = "every worker that finishes its steps must also finish its exit, whatever the load.\n"
ABORT = re.compile(r"terminate called|exitcode\s*:\s*-6\b|Signal 6 \(SIGABRT\)|SIGABRT")


@dataclass(frozen=True)
class Outcome:
    index: int
    returncode: int
    aborted: bool
    tail: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.aborted


def job_command(workdir: Path, steps: int, fsdp: bool = False) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "--max-restarts=0", "--monitor-interval=0.5", str(GPT_RECIPE),
        "--device", "cpu", "--max-steps", str(steps), "--ckpt-every", "2", "--ckpt-dir", str(workdir / "ckpt"),
        "--eval-every", "0", "--sample-tokens", "0", "--data", str(workdir / "corpus.txt"), *TINY_GPT,
        *(["--fsdp"] if fsdp else []),
    ]


def job_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return env


def run_once(index: int, root: Path, steps: int, timeout: float, fsdp: bool = False) -> Outcome:
    workdir = root / f"run{index:03d}"
    workdir.mkdir()
    (workdir / "corpus.txt").write_text(CORPUS * 200)
    try:
        done = subprocess.run(
            job_command(workdir, steps, fsdp), capture_output=True, text=True, timeout=timeout, env=job_env(), cwd=REPO,
        )
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
        output, code = output + f"\n(timed out after {timeout:g} s)", -9
    return Outcome(index, code, bool(ABORT.search(output)), output[-4000:])


def burn(stop: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def stress(runs: int, parallel: int, burners: int, steps: int, timeout: float, fsdp: bool = False) -> list[Outcome]:
    """Run the job `runs` times, `parallel` at a time, beside `burners` CPU burners."""
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    spinning = [context.Process(target=burn, args=(stop,), daemon=True) for _ in range(burners)]
    for process in spinning:
        process.start()
    try:
        with tempfile.TemporaryDirectory(prefix="exit-stress-") as root, ThreadPoolExecutor(parallel) as pool:
            return list(pool.map(lambda i: run_once(i, Path(root), steps, timeout, fsdp), range(runs)))
    finally:
        stop.set()
        for process in spinning:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=50, help="jobs to run")
    p.add_argument("--parallel", type=int, default=2, help="jobs at a time")
    p.add_argument("--burners", type=int, default=1, help="CPU-burning processes beside the jobs")
    p.add_argument("--steps", type=int, default=4, help="training steps per job")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a job counts as hung")
    p.add_argument("--fsdp", action="store_true", help="the recipe sharded with FSDP2 (its exit tears down a device mesh too)")
    args = p.parse_args(argv)
    started = time.monotonic()
    outcomes = stress(args.runs, args.parallel, args.burners, args.steps, args.timeout, args.fsdp)
    for outcome in outcomes:
        if not outcome.ok:
            kind = "ABORT" if outcome.aborted else "FAILED"
            print(f"--- run {outcome.index}: {kind}, exit {outcome.returncode}\n{outcome.tail}", flush=True)
    aborts = sum(o.aborted for o in outcomes)
    others = sum(not o.ok and not o.aborted for o in outcomes)
    print(f"{len(outcomes)} runs, {aborts} aborts, {others} other failures ({time.monotonic() - started:.0f} s)")
    return 0 if aborts == 0 and others == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
