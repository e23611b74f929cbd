"""Survivors keep their processes (elastic.regroup): a worker SIGKILLed while its peers
wait on it in the gradient all-reduce is replaced by one new process; the others turn
the failed step into a void one, form the next group in place, hand their state to the
replacement and train on. Three real processes on gloo; the test stands in for the agent
(it hosts the store that outlives the dead worker and starts the replacement)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from support import REPO, worker_env

pytestmark = pytest.mark.slow

WORLD, STEPS, KILLED_RANK = 3, 24, 2

WORKER = textwrap.dedent("""
    import hashlib, json, os, signal, sys, time
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from elastic import regroup

    rank, world, port, generation, steps, kill_at = map(int, sys.argv[1:7])
    report = open(sys.argv[7], "a")
    replacement = generation > 0
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    regroup.rejoin(store, generation=generation, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    # A replacement's DDP makes no collective of its own: its state comes from a survivor below.
    ddp = DDP(model, bucket_cap_mb=0.001, init_sync=not replacement)
    guard = regroup.StepGuard()
    guard.attach(ddp)
    guard.guard(optimizer)
    completed, trained, regrouped = 0, [], 0

    def heal(completed):
        agreed = regroup.agree(completed)
        regroup.share_state(model, optimizer, src=agreed.source)
        return agreed

    if replacement:
        regroup.prepare_optimizer_state(optimizer)
        completed = heal(0).most
    while completed < steps:
        g = torch.Generator().manual_seed(1000 * completed + rank)  # this rank's batch of this step
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        if rank == {killed} and completed == kill_at and not replacement:
            time.sleep(0.5)  # the peers are inside this step's all-reduce, waiting on this rank
            os.kill(os.getpid(), signal.SIGKILL)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if guard.void:
            print(f"rank {rank}: step {completed + 1} is void ({guard.error})", flush=True)
            generation += 1
            regroup.rejoin(store, generation=generation, rank=rank, world_size=world, timeout=timedelta(seconds=60))
            regroup.rebind(ddp, guard)
            guard.clear()
            agreed = heal(completed)
            completed, regrouped = agreed.most, regrouped + 1
            continue
        completed += 1
        trained.append(completed)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    report.write(json.dumps({"rank": rank, "pid": os.getpid(), "trained": trained, "regrouped": regrouped,
                             "digest": digest, "final": [p.detach().tolist() for p in model.parameters()]}) + "\\n")
    report.close()
    dist.barrier()
    dist.destroy_process_group()
""").replace("{killed}", str(KILLED_RANK))


def start(script: Path, rank: int, port: int, generation: int, kill_at: int, report: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(script), str(rank), str(WORLD), str(port), str(generation), str(STEPS), str(kill_at),
         str(report)],
        env=worker_env(PYTHONPATH=str(REPO)), cwd=script.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )


def run_job(tmp_path: Path, kill_at: int) -> tuple[dict[int, dict], dict[int, int], str]:
    """Run the job (with a SIGKILL of KILLED_RANK at step `kill_at`, none when -1); each
    rank's report, each process's exit status by pid, and everything the processes printed."""
    script, report = tmp_path / "worker.py", tmp_path / f"report{kill_at}.jsonl"
    script.write_text(WORKER)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    procs = [start(script, rank, store.port, 0, kill_at, report) for rank in range(WORLD)]
    outputs = []
    try:
        if kill_at >= 0:
            procs[KILLED_RANK].wait(timeout=120)
            outputs.append(procs[KILLED_RANK].stdout.read())
            procs.append(start(script, KILLED_RANK, store.port, 1, kill_at, report))  # the agent's replacement
        for proc in procs:
            proc.wait(timeout=120)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    outputs += [proc.stdout.read() for proc in procs if not proc.stdout.closed]
    reports = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    return {r["rank"]: r for r in reports}, {proc.pid: proc.returncode for proc in procs}, "\n".join(outputs)


def test_survivors_keep_their_processes_and_the_replacement_takes_their_state(tmp_path: Path) -> None:
    kill_at = 9
    reports, exits, printed = run_job(tmp_path, kill_at)
    first_pids = list(exits)[:WORLD]
    assert exits[first_pids[KILLED_RANK]] == -9, printed
    assert [code for pid, code in exits.items() if pid != first_pids[KILLED_RANK]] == [0] * WORLD, printed
    assert sorted(reports) == list(range(WORLD)), printed

    survivors = [rank for rank in range(WORLD) if rank != KILLED_RANK]
    for rank in survivors:
        assert reports[rank]["pid"] == first_pids[rank], "a survivor is the process it started as"
        assert reports[rank]["regrouped"] == 1
        # Exactly once: the void step (kill_at + 1) was trained again, no step twice.
        assert reports[rank]["trained"] == list(range(1, STEPS + 1)), printed
        assert f"rank {rank}: step {kill_at + 1} is void" in printed
    replacement = reports[KILLED_RANK]
    assert replacement["pid"] not in first_pids
    assert replacement["trained"] == list(range(kill_at + 1, STEPS + 1)), "it starts where the survivors are"
    assert len({reports[rank]["digest"] for rank in range(WORLD)}) == 1, "every rank ends with the same weights"


def test_a_healed_job_ends_where_an_uninterrupted_one_does(tmp_path: Path) -> None:
    """The same batches, each trained once: the weights match an uninterrupted run's up to the
    summation order of the one step after the heal (a fresh bucket layout; see elastic.regroup)."""
    import torch

    healed, _, printed = run_job(tmp_path, 14)
    clean, exits, clean_printed = run_job(tmp_path, -1)
    assert list(exits.values()) == [0] * WORLD, clean_printed
    assert all(clean[rank]["regrouped"] == 0 for rank in range(WORLD))
    for got, want in zip(healed[0]["final"], clean[0]["final"]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6, msg=printed)
