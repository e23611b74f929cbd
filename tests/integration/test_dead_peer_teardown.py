"""A worker that fails while a peer is dead or stuck leaves its process group without
waiting on that peer: the error path's teardown is bounded, so it never adds the
collective timeout (or the agent's shutdown timeout) to a recovery."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import warm
from support import REPO, free_port, worker_env

pytestmark = pytest.mark.slow

COLLECTIVE_TIMEOUT_S = 300  # what a teardown that waited on the peer would cost
BOUND_S = 150  # rank 0's whole life, start-up included; only such a wait would exceed it

WORKER = textwrap.dedent(f"""
    import os, signal, sys, time
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from elastic._worker.runtime.context import worker_context

    rank, how = int(os.environ["RANK"]), sys.argv[1]
    try:
        with worker_context("cpu", timeout=timedelta(seconds={COLLECTIVE_TIMEOUT_S})):
            dist.all_reduce(torch.ones(1))  # both ranks are in
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            time.sleep(1)
            pending = dist.all_reduce(torch.ones(1), async_op=True)  # in flight when the step fails
            time.sleep(0.5)
            raise RuntimeError("the step failed")
    except RuntimeError as error:
        print(f"rank {{rank}} left: {{error}}; group still up: {{dist.is_initialized()}}", flush=True)
        sys.exit(3)
""")


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_failed_worker_leaves_the_group_promptly_when_its_peer_is_dead_or_stuck(tmp_path: Path, how: str) -> None:
    """gloo's destroy waits for a collective in flight to a SIGSTOPped peer until the
    collective timeout; the error path gives it a short deadline and goes on."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = worker_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", PYTHONPATH=str(REPO))
    # Forked warm (tests/warm.py): the test is about the teardown, not an interpreter's start.
    peer = warm.start([sys.executable, str(script), how], env={**env, "RANK": "1"}, cwd=tmp_path,
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        done = warm.run([sys.executable, str(script), how], env={**env, "RANK": "0"}, cwd=tmp_path, timeout=BOUND_S)
    finally:
        peer.kill()
        peer.wait()
    assert done.returncode == 3, done.stdout + done.stderr
    assert "rank 0 left: the step failed" in done.stdout, done.stdout + done.stderr
    overran = [line for line in done.stderr.splitlines() if "leaving it to process exit" in line]
    if how == "stop":
        assert len(overran) == 1, done.stderr
        assert "rank 0: leaving the process group after a failure took over" in overran[0]
        assert "Traceback" not in done.stderr
