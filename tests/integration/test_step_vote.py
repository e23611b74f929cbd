"""The step vote on a real two-rank gloo group: each vote is read at the next vote step, the same
verdict on every rank, and the ranks agree on how far apart votes are (ranks as threads of this
process); a SIGTERM to one rank of a real two-process job stops every rank at the same step, within
two votes, with that step committed."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import warm
from support import REPO, free_port, worker_env
from thread_ranks import run_ranks

from elastic._worker.control.step_vote import MAX_EVERY, Ballot, StepVote
from elastic._worker.runtime.context import WorkerContext

pytestmark = pytest.mark.slow

def votes(ctx: WorkerContext, group: Any) -> dict[str, Any]:
    """One rank's votes through a loop: what it reads at each step end and when it votes."""
    rank = ctx.rank
    ballot = {"preempted": False, "storage": False, "every": 3 if rank == 0 else 5}
    now = [0.0]

    def cast():
        return Ballot(preempted=ballot["preempted"], storage_failing=ballot["storage"], snapshot_every=ballot["every"])

    def plain(verdict):
        return None if verdict is None else [verdict.preempted, verdict.storage_failing, verdict.snapshot_every,
                                             verdict.vote_every]

    vote = StepVote(ctx, cast, grace=15.0, clock=lambda: now[0], group=group)
    seen = []

    def end(step, seconds):
        now[0] += seconds
        seen.append(plain(vote.step_ended(step)))

    end(1, 1.0)  # no vote in flight: nothing; step 1's vote starts
    if rank == 0:
        ballot["preempted"] = True  # during step 2
    end(2, 1.0)  # step 1's verdict
    ballot["preempted"] = False
    end(3, 1.0)  # step 2's verdict carries rank 0's flag
    ballot["storage"] = rank == 1
    seen.append(plain(vote.fresh()))  # between steps: step 3's vote and a fresh one, merged
    ballot["storage"] = False
    seen.append(plain(vote.settle()))  # nothing in flight after fresh
    # Steps of 0.25 s: about VOTE_SECONDS of steps is 4 steps between votes, once agreed.
    quick, voted, foretold = StepVote(ctx, cast, grace=15.0, clock=lambda: now[0], group=group), [], []
    for step in range(1, 16):
        now[0] += 0.25
        before = quick.votes
        if quick.votes_at(step):  # (the soak's during_vote fault point fires there)
            foretold.append(step)
        quick.step_ended(step)
        if quick.votes > before:
            voted.append(step)
    quick.settle()
    assert foretold == voted, "votes_at says which step ends cast a vote, before they do"
    return {"seen": seen, "voted": voted, "every": quick.every}


def run_pair(tmp_path: Path, script: str, *args: str, timeout: float = 120) -> list[subprocess.CompletedProcess[str]]:
    """`script` as ranks 0 and 1 of a two-process job (forked warm: tests/warm.py); how each ended."""
    path = tmp_path / "worker.py"
    path.write_text(script)
    env = worker_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                     PYTHONPATH=str(REPO))
    procs = []
    try:
        for rank in (0, 1):
            with open(tmp_path / f"out{rank}", "wb") as out, open(tmp_path / f"err{rank}", "wb") as err:
                procs.append(warm.start([sys.executable, str(path), *args], env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                        cwd=tmp_path, stdout=out, stderr=err))
        codes = [proc.wait(timeout) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    return [
        subprocess.CompletedProcess(proc.args, code, (tmp_path / f"out{rank}").read_text(), (tmp_path / f"err{rank}").read_text())
        for rank, (proc, code) in enumerate(zip(procs, codes))
    ]


def test_every_rank_reads_each_vote_at_the_next_vote_step() -> None:
    """Two ranks as threads (tests/thread_ranks.py), each voting on a gloo group of its own."""
    rank0, rank1 = run_ranks(2, votes)
    assert rank0 == rank1 == {
        "seen": [
            [False, False, 0, 0],  # the first step end of a loop reads no vote
            [False, False, 5, 1],  # step 1's: the largest snapshot interval proposed; 1-second steps: vote every step
            [True, False, 5, 1],  # step 2's: rank 0's SIGTERM flag of step 2
            [False, True, 5, 1],  # fresh: rank 1's storage flag raised just before counts
            None,
        ],
        "voted": [1, 2, 3, 5, 9, 13],  # every 4 steps (1, 2, then 4: at most doubling) once the 0.25 s steps are measured
        "every": 4,
    }


def slots_through_pauses(ctx: WorkerContext, group: Any) -> list[tuple[int, ...]]:
    """One rank's step ends with a pause (`fresh`) between every two: what slots each step end reads."""
    ticket = [0]
    vote = StepVote(ctx, lambda: Ballot(), grace=15.0, group=group,
                    slots=lambda: [ticket[0] if ctx.rank == 0 else 0, 7 * (ctx.rank + 1)])
    seen = []
    for step in range(1, 5):
        seen.append(vote.step_ended(step).slots)
        ticket[0] = 10 * step  # (rank 0's reading of the newest joiner ticket, say)
        vote.fresh()  # between steps: it reads the vote in flight and takes its own
    seen.append(vote.step_ended(5).slots)
    vote.settle()
    return seen


def test_slots_a_pause_read_reach_the_parts_at_the_next_step_end() -> None:
    """With a pause between every two steps `fresh` reads every vote: its slots are handed on at the next
    step end, else a part would never learn of them (train-on's joiners never admitted)."""
    rank0, rank1 = run_ranks(2, slots_through_pauses)
    assert rank0 == rank1 == [(), (10, 14), (20, 14), (30, 14), (40, 14)]


PREEMPTED = textwrap.dedent("""
    import os, signal, sys
    import torch
    import elastic
    from elastic._shared.common.errors import Preempted

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
                if rank == 1 and run.step == 4:  # in step 5: the next vote carries it
                    os.kill(os.getpid(), signal.SIGTERM)
    except Preempted as stop:
        print(f"rank {rank}: {stop}", flush=True)
        sys.exit(143)
""")


def test_a_sigterm_to_one_rank_stops_every_rank_at_one_step_within_two_votes(tmp_path: Path) -> None:
    from elastic._worker.observe.events import read_events

    ckpt = tmp_path / "ckpt"
    rank0, rank1 = run_pair(tmp_path, PREEMPTED, str(ckpt))
    assert rank0.returncode == rank1.returncode == 143, rank0.stderr[-3000:] + rank1.stderr[-3000:]
    stopped = [re.search(r"stopped by SIGTERM after step (\d+); checkpoint committed", done.stdout) for done in (rank0, rank1)]
    assert all(stopped), rank0.stdout + rank1.stdout
    step = int(stopped[0].group(1))
    assert int(stopped[1].group(1)) == step, "the ranks stopped at different steps"
    assert 5 <= step <= 5 + 2 * MAX_EVERY, step  # within two vote intervals of the signal (in step 5)
    saved = [(e["step"], e["reason"]) for e in read_events(tmp_path / "ev.jsonl") if e["event"] == "checkpoint"]
    assert saved == [(step, "preemption")]
