"""The step vote on a real two-process gloo group: started at the optimizer step on one rank and
at the step's end on another, it is still one collective with one verdict; a SIGTERM during the
optimizer step stops every rank one step later, at the same step, with that step committed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import REPO, free_port, worker_env

pytestmark = pytest.mark.slow

VOTES = textwrap.dedent("""
    import json, os
    from elastic.runtime import worker_context
    from elastic.step_vote import StepVote

    rank = int(os.environ["RANK"])
    ballot = {"preempted": False, "storage": False, "every": 0}
    with worker_context("cpu") as ctx:
        vote = StepVote(ctx, lambda: (ballot["preempted"], ballot["storage"], ballot["every"]))
        seen = []
        # Step 1: rank 0 votes at its optimizer step, rank 1 (no optimizer step) at the step's end.
        vote.open_step()
        ballot["every"] = 3 if rank == 0 else 5
        if rank == 0:
            vote.start()
            ballot["preempted"] = True  # after its vote started: carried by the next one
        seen.append(vote.result())
        # Step 2: both vote at the optimizer step; a second start in the same step is no second vote.
        vote.open_step()
        vote.start()
        vote.start()
        seen.append(vote.result())
        # Between steps: a vote in flight and a fresh one, merged.
        ballot["preempted"] = False
        vote.open_step()
        ballot["storage"] = rank == 1
        vote.start()
        ballot["storage"] = False
        seen.append(vote.fresh())
        # No step open (an optimizer step outside the loop): no vote starts.
        vote.start()
        seen.append(vote.settle())
        print(json.dumps([None if v is None else [v.preempted, v.storage_failing, v.snapshot_every] for v in seen]
                         + [vote.early, vote.late]))
""")


def run_pair(tmp_path: Path, script: str, *args: str, timeout: float = 120) -> list[subprocess.CompletedProcess[str]]:
    path = tmp_path / "worker.py"
    path.write_text(script)
    env = worker_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                     PYTHONPATH=str(REPO))
    procs = [
        subprocess.Popen([sys.executable, str(path), *args], env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                         cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            proc.kill()
    return done


def test_ranks_voting_at_different_points_read_one_verdict(tmp_path: Path) -> None:
    rank0, rank1 = run_pair(tmp_path, VOTES)
    assert rank0.returncode == rank1.returncode == 0, rank0.stderr[-3000:] + rank1.stderr[-3000:]
    verdicts0, verdicts1 = json.loads(rank0.stdout), json.loads(rank1.stdout)
    assert verdicts0[:4] == verdicts1[:4] == [
        [False, False, 5],  # the flag rank 0 raised after its vote started is not in this one
        [True, False, 5],  # ... but in the next
        [False, True, 5],  # fresh: the storage flag of the vote in flight counts
        None,
    ]
    assert verdicts0[4:] == [3, 0] and verdicts1[4:] == [2, 1]  # (at an optimizer step, at a step's end)


PREEMPTED = textwrap.dedent("""
    import os, signal, sys
    import torch
    import elastic
    from elastic.errors import Preempted

    rank, ckpt = int(os.environ["RANK"]), sys.argv[1]
    try:
        with elastic.Run(device="cpu", ckpt_dir=ckpt, events=os.path.join(ckpt, "..", "ev.jsonl"),
                         snapshot_every=0) as run:
            model = run.ddp(torch.nn.Linear(4, 1))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            run.start(model=model, optimizer=optimizer, data=64, batch_size=2)
            for batch in run.batches(max_steps=50):
                loss = model(torch.ones(2, 4) * batch.float().mean()).sum()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if rank == 1 and run.step == 4:  # in step 5, after its optimizer step started the vote
                    os.kill(os.getpid(), signal.SIGTERM)
    except Preempted as stop:
        print(f"rank {rank}: {stop}", flush=True)
        sys.exit(143)
""")


def test_a_sigterm_during_the_optimizer_step_stops_every_rank_one_step_later(tmp_path: Path) -> None:
    from elastic.events import read_events

    ckpt = tmp_path / "ckpt"
    rank0, rank1 = run_pair(tmp_path, PREEMPTED, str(ckpt))
    assert rank0.returncode == rank1.returncode == 143, rank0.stderr[-3000:] + rank1.stderr[-3000:]
    for rank, done in enumerate((rank0, rank1)):
        assert f"rank {rank}: stopped by SIGTERM after step 6; checkpoint committed" in done.stdout, done.stdout
    saved = [(e["step"], e["reason"]) for e in read_events(tmp_path / "ev.jsonl") if e["event"] == "checkpoint"]
    assert saved == [(6, "preemption")]
