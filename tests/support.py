"""Helpers for tests that start real processes: ports, text, torchrun agents."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPT_RECIPE = REPO / "recipes" / "gpt.py"

WORDS = (
    "the quick brown fox jumps over a lazy dog while every worker keeps its step and "
    "no sample is lost when the job restarts from the last checkpoint on another node"
).split()


def make_text(rng: random.Random, size: int) -> str:
    """Sentences of common words: structured enough that a model's loss falls fast."""
    out: list[str] = []
    length = 0
    while length < size:
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))).capitalize() + ".\n"
        out.append(sentence)
        length += len(sentence)
    return "".join(out)[:size]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(**extra: str) -> dict[str, str]:
    """The environment for a child job: no inherited torchrun variables, quiet threads."""
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, **extra)
    return env


def torchrun_command(
    *,
    nnodes: str,
    port: int,
    run_id: str,
    script_args: Sequence[str],
    nproc_per_node: int = 1,
    max_restarts: int = 0,
    rdzv_conf: str = "join_timeout=60,last_call_timeout=3,close_timeout=5",
) -> list[str]:
    """One torchrun agent of a c10d job on loopback, running the GPT recipe."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf={rdzv_conf}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.5",
        "--local-addr=127.0.0.1",
        str(GPT_RECIPE),
        *script_args,
    ]


def start_agents(count: int, command: list[str], log_dir: Path) -> list[subprocess.Popen]:
    """Start `count` identical agents, each logging to its own file."""
    procs = []
    for i in range(count):
        log = open(log_dir / f"agent{i}.log", "wb")
        procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=worker_env(), cwd=REPO))
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Exit codes of every agent; kills the rest if one overruns `timeout`."""
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes
