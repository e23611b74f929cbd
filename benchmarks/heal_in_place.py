"""A worker's death healed in place against a new rendezvous round, side by side.

`benchmarks/heal_worker.py` (a small DDP model on `elastic._worker.survivors.regroup`) runs under
torchrevive-run, `--agents` agents of one worker each (c10d, one machine); the
worker of the last rank SIGKILLs itself inside a step's all-reduce. Settings,
taking turns run by run:

- keep: `TORCHREVIVE_SURVIVORS=keep`: its agent replaces it without a round, the
  other workers keep their processes and hand the replacement their state;
- round: the same script without it: the survivors exit, and every agent restarts
  its worker through a new rendezvous round (quick rounds, warm workers), as
  torchrevive-run does for a script that does not heal. The script keeps no
  checkpoint, so its workers then start from step 0: only the time is compared.

Measured per run: seconds from the kill to the next step rank 0 completes, and
how many worker processes the job started. Prints medians and the ratio.

    python benchmarks/heal_in_place.py [--runs 4] [--agents 3] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "benchmarks" / "heal_worker.py"
SETTINGS = ("keep", "round")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(setting: str, agents: int, steps: int, kill_at: int, directory: Path) -> dict:
    report = directory / "report.jsonl"
    command = [
        sys.executable, "-m", "elastic._agent.launcher", f"--nnodes={agents}:{agents}", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={directory.name}",
        "--max-restarts=2", "--monitor-interval=0.5", "--local-addr=127.0.0.1",
        str(WORKER), str(steps), str(kill_at), str(agents - 1), str(report),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("TORCHREVIVE_SURVIVORS", None)
    if setting == "keep":
        env["TORCHREVIVE_SURVIVORS"] = "keep"
    logs = [open(directory / f"agent{i}.log", "wb") for i in range(agents)]
    procs = [subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO) for log in logs]
    try:
        codes = [proc.wait(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    if codes != [0] * agents:
        tail = (directory / "agent0.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{setting}: agents exited {codes}\n{tail}")
    killed = float((directory / "report.jsonl.killed").read_text())
    step_times = [json.loads(line)["t"] for line in (directory / "report.jsonl.steps").read_text().splitlines()]
    started = (directory / "report.jsonl.started").read_text().splitlines()
    return {"recovery_s": min(t for t in step_times if t > killed) - killed, "processes": len(started)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=4, help="runs per setting")
    parser.add_argument("--agents", type=int, default=3, help="agents (nodes) of one worker each, at least 2")
    parser.add_argument("--steps", type=int, default=40, help="training steps per run")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.agents < 2 or args.steps < 4:
        parser.error("--runs >= 1, --agents >= 2, --steps >= 4")
    kill_at = args.steps // 2
    results: dict[str, list[dict]] = {setting: [] for setting in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="heal-in-place-") as scratch:
        for run in range(args.runs):
            for setting in SETTINGS:
                directory = Path(scratch) / f"{setting}{run}"
                directory.mkdir()
                started = time.perf_counter()
                result = run_once(setting, args.agents, args.steps, kill_at, directory)
                results[setting].append(result)
                print(f"run {run + 1} {setting}: kill -> next step {result['recovery_s']:.3f} s, "
                      f"{result['processes']} worker processes started ({time.perf_counter() - started:.0f} s)",
                      flush=True)
    print("\n".join(report(results, args.agents)))
    return 0


def report(results: dict[str, list[dict]], agents: int) -> list[str]:
    """The lines printed from each setting's runs (`run_once`'s dicts): the median recovery, the worker
    processes a run started, and keep / round."""
    medians = {setting: statistics.median(r["recovery_s"] for r in results[setting]) for setting in SETTINGS}
    lines = []
    for setting in SETTINGS:
        times = ", ".join(f"{r['recovery_s']:.2f}" for r in results[setting])
        lines.append(f"{setting}: median {medians[setting]:.3f} s ({times}); worker processes started per run: "
                     f"{results[setting][0]['processes']}")
    lines.append(f"heal in place / new round: {medians['keep'] / medians['round']:.2f} of the time "
                 f"({medians['round'] / medians['keep']:.1f}x faster), {agents} agents")
    return lines


if __name__ == "__main__":
    sys.exit(main())
