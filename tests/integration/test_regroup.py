"""Survivors keep their processes (elastic._worker.survivors.regroup): a worker SIGKILLed while its peers
wait on it in the gradient all-reduce is replaced by one new process; the others turn
the failed step into a void one, form the next group in place, hand their state to the
replacement and train on. Three real processes on gloo; the test stands in for the agent
(it hosts the store that outlives the dead worker and starts the replacement)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
import warm
from support import (
    REPO,
    free_port,
    start_agents,
    torchrun_command,
    wait_all,
    worker_env,
)

from elastic._shared.protocol import heal_env
from elastic._shared.storage.sealed_store import SealedStore
from elastic._worker.survivors import regroup

pytestmark = pytest.mark.slow

WORLD, STEPS, KILLED_RANK = 4, 24, 3  # ranks 1 and 2 are no ring neighbours of 3

WORKER = REPO / "tests" / "heal_worker.py"  # a DDP script on elastic._worker.survivors.regroup


NAMESPACE = "test"


def start(script: Path, rank: int, port: int, generation: int, kill_at: int, report: Path) -> warm.WarmProcess:
    env = worker_env(
        PYTHONPATH=str(REPO), RANK=str(rank), WORLD_SIZE=str(WORLD),
        **{heal_env.HEAL_STORE_ENV: f"127.0.0.1:{port}", heal_env.HEAL_NAMESPACE_ENV: NAMESPACE,
           heal_env.HEAL_GENERATION_ENV: str(generation)},
    )
    # Forked warm (tests/warm.py): 9 fresh interpreters cost this file's test half its time.
    log = report.parent / f"{report.stem}.rank{rank}.g{generation}.log"
    with open(log, "wb") as out:
        proc = warm.start([sys.executable, str(script), str(STEPS), str(kill_at), str(KILLED_RANK), str(report)],
                          env=env, cwd=report.parent, stdout=out, stderr=subprocess.STDOUT)
    proc.log = log
    return proc


def run_job(tmp_path: Path, kill_at: int) -> tuple[dict[int, dict], dict[int, int], str]:
    """Run the job (with a SIGKILL of KILLED_RANK at step `kill_at`, none when -1); each
    rank's report, each process's exit status by pid, and everything the processes printed.
    The test plays the agent: it hosts the store and, after the kill, counts the heal and
    starts the replacement."""
    script, report = WORKER, tmp_path / f"report{kill_at}.jsonl"
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    procs = [start(script, rank, store.port, 0, kill_at, report) for rank in range(WORLD)]
    try:
        if kill_at >= 0:
            procs[KILLED_RANK].wait(timeout=120)
            # As the agent counts it: through the sealed store the workers read (unsigned here: no secret,
            # no launch), whose counters are sealed values, not the TCPStore's numbers.
            heals = dist.PrefixStore(heal_env.namespace_prefix(NAMESPACE), SealedStore(store, None, ""))
            generation = heals.add(heal_env.GENERATION_KEY, 1)
            procs.append(start(script, KILLED_RANK, store.port, generation, kill_at, report))
        for proc in procs:
            proc.wait(timeout=120)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    outputs = [proc.log.read_text(errors="replace") for proc in procs]
    reports = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    return {r["rank"]: r for r in reports}, {proc.pid: proc.returncode for proc in procs}, "\n".join(outputs)


def check_survivors(kill_at: int, reports: dict[int, dict], exits: dict[int, int], printed: str) -> None:
    """Every survivor kept its process and trained every step once, the void step again; the
    replacement is a new process that starts where the survivors are; every rank ends with the same weights."""
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
    # Every survivor learned of the death at once (its neighbour let go of the broken group), none
    # from the collective timeout: in a ring of 4, rank 1 is next to no dead rank.
    assert "Timed out" not in printed, printed
    replacement = reports[KILLED_RANK]
    assert replacement["pid"] not in first_pids
    assert replacement["trained"] == list(range(kill_at + 1, STEPS + 1)), "it starts where the survivors are"
    assert len({reports[rank]["digest"] for rank in range(WORLD)}) == 1, "every rank ends with the same weights"


def test_a_death_before_any_optimizer_step_is_healed_in_place(tmp_path: Path) -> None:
    """Killed at step 0 (the replacement takes the initial state from the survivors)."""
    check_survivors(0, *run_job(tmp_path, 0))


def test_a_death_mid_run_is_healed_in_place_and_the_job_ends_where_an_uninterrupted_one_does(tmp_path: Path) -> None:
    """Killed at step 9: the survivors keep their processes and the replacement takes their state; the
    same batches, each trained once: the weights match an uninterrupted run's up to the summation
    order of the one step after the heal (a fresh bucket layout; see elastic._worker.survivors.regroup)."""
    import torch

    healed, healed_exits, printed = run_job(tmp_path, 9)
    check_survivors(9, healed, healed_exits, printed)
    assert sorted(healed_exits.values()) == [-9] + [0] * WORLD, printed
    clean, exits, clean_printed = run_job(tmp_path, -1)
    assert list(exits.values()) == [0] * WORLD, clean_printed
    assert all(clean[rank]["regrouped"] == 0 for rank in range(WORLD))
    for got, want in zip(healed[0]["final"], clean[0]["final"]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6, msg=printed)


def test_under_torchrevive_run_only_the_failed_worker_is_replaced_and_no_round_is_held(tmp_path: Path) -> None:
    """Three agents of one worker each (TORCHREVIVE_SURVIVORS=keep): the SIGKILLed worker's agent
    starts its replacement without a rendezvous round; the other two workers are never restarted."""
    script, report, kill_at = WORKER, tmp_path / "report.jsonl", 7
    command = torchrun_command(
        nnodes=f"{WORLD}:{WORLD}", port=free_port(), run_id=tmp_path.name, max_restarts=1, script=script,
        script_args=[str(STEPS), str(kill_at), str(KILLED_RANK), str(report)],
    )
    command[2] = "elastic._agent.launcher"  # torchrevive-run, not torchrun
    env = worker_env(PYTHONPATH=str(REPO), **{heal_env.SURVIVORS_ENV: "keep"})
    agents = start_agents(WORLD, command, tmp_path, env=env)
    assert wait_all(agents, timeout=240) == [0] * WORLD, logs_of(tmp_path)

    started = [json.loads(line) for line in Path(f"{report}.started").read_text().splitlines()]
    by_rank = {rank: [s for s in started if s["rank"] == rank] for rank in range(WORLD)}
    assert [(s["generation"]) for s in by_rank[KILLED_RANK]] == [0, 1], logs_of(tmp_path)
    reports = {r["rank"]: r for r in map(json.loads, report.read_text().splitlines())}
    for rank in range(WORLD):
        if rank == KILLED_RANK:
            continue
        assert [s["pid"] for s in by_rank[rank]] == [reports[rank]["pid"]], "a survivor was started once"
        assert reports[rank]["regrouped"] == 1 and reports[rank]["trained"] == list(range(1, STEPS + 1))
    assert reports[KILLED_RANK]["trained"] == list(range(kill_at + 1, STEPS + 1))
    assert len({r["digest"] for r in reports.values()}) == 1
    healed = [log for log in sorted(tmp_path.glob("agent*.log")) if "in place (heal 1)" in log.read_text()]
    assert len(healed) == 1, logs_of(tmp_path)
    assert not any("Timed out" in log.read_text() for log in tmp_path.glob("agent*.log")), logs_of(tmp_path)


def logs_of(directory: Path) -> str:
    return "\n".join(
        f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}" for log in sorted(directory.glob("agent*.log"))
    )


def heal_variables(store: str, namespace: str, generation: str) -> dict[str, str]:
    return {heal_env.HEAL_STORE_ENV: store, heal_env.HEAL_NAMESPACE_ENV: namespace,
            heal_env.HEAL_GENERATION_ENV: generation}


def test_the_heal_point_counts_what_the_agent_counts() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    point = regroup.heal_point(heal_variables(f"127.0.0.1:{server.port}", namespace="job/a:1", generation="2"))
    assert point is not None and point.generation == 2
    agent_side = dist.PrefixStore(heal_env.namespace_prefix("job/a:1"), server)
    agent_side.add(heal_env.GENERATION_KEY, 2)  # two heals already: this worker was started by the second
    with pytest.raises(regroup.RegroupError, match="heal 3 never began"):
        regroup.next_generation(point, after=2, timeout=timedelta(seconds=0.05))
    counted = threading.Timer(0.2, lambda: agent_side.add(heal_env.GENERATION_KEY, 1))
    counted.start()
    assert regroup.next_generation(point, after=2, timeout=timedelta(seconds=30)) == 3
    counted.join()


GIVES_UP = textwrap.dedent("""
    import json, os, sys, time
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from elastic._shared.protocol import heal_env
    from elastic._worker.survivors import regroup

    started_path, mode = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    point = regroup.heal_point(os.environ)
    seen = [json.loads(line)["rank"] for line in open(started_path)] if os.path.exists(started_path) else []
    first = rank not in seen
    with open(started_path, "a") as started:
        started.write(json.dumps({"rank": rank, "pid": os.getpid(), "generation": point.generation}) + "\\n")
    if mode == "heals":
        regroup.rejoin(point.store, generation=point.generation, rank=rank, world_size=world,
                       timeout=timedelta(seconds=60))
    else:
        dist.init_process_group("gloo")  # a script that does not heal: it never counts itself a healer
    if first and rank == 1:
        sys.exit(heal_env.HEAL_FAILED_EXIT if mode == "heals" else 1)
    if first:
        time.sleep(120)  # until its agent stops it for the new round
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("mode", ["heals", "plain"])
def test_a_failure_that_cannot_heal_makes_the_agents_hold_a_new_round(tmp_path: Path, mode: str) -> None:
    """Exit status 76 (the heal's peers never came), or a script that never counted itself a healer
    (an ordinary failure of a script without elastic._worker.survivors.regroup), is not healed in place: the agents
    meet in a new round and every worker starts again, as under torchrun."""
    script, started = tmp_path / "worker.py", tmp_path / "started.jsonl"
    script.write_text(GIVES_UP)
    command = torchrun_command(nnodes="2:2", port=free_port(), run_id=tmp_path.name, max_restarts=1, script=script,
                               script_args=[str(started), mode])
    command[2] = "elastic._agent.launcher"
    env = worker_env(PYTHONPATH=str(REPO), **{heal_env.SURVIVORS_ENV: "keep"})
    assert wait_all(start_agents(2, command, tmp_path, env=env), timeout=180) == [0, 0], logs_of(tmp_path)
    starts = [json.loads(line) for line in started.read_text().splitlines()]
    # Each rank started twice (the second time in a new round, at generation 0 again); the worker that
    # had not failed was restarted too: its agent saw a node waiting for the new round.
    assert sorted((s["rank"], s["generation"]) for s in starts) == [(0, 0), (0, 0), (1, 0), (1, 0)], starts
    assert len({s["pid"] for s in starts}) == 4, starts
    assert not any("in place" in log.read_text() for log in tmp_path.glob("agent*.log"))
