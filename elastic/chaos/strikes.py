"""How each chaos scenario hurts a started job (`SCENARIOS`), and when its fault is due.

A scenario is a function of the job (harness.ChaosJob) and the run's random
generator: it waits until its fault is due (`when_due`: training under way, or,
in a chain, the fault before recovered from and a few steps trained since),
strikes, and returns the exit codes it expects of the agents it hurt. Faults the
workers inject themselves (ELASTIC_FAULT, scenarios.py's `SCENARIO_FAULTS`) need no
strike: their scenario at most marks when the fault struck, from the event log.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable

from elastic.chaos.harness import ChaosJob

Scenario = Callable[[ChaosJob, random.Random], dict[int, int]]
"""Hurts a started job once the fault is due (`when_due`); returns the exit codes expected of the
agents it hurt, by index: every other agent must exit 0."""


def when_due(job: ChaosJob, rng: random.Random) -> float:
    """Wait until the next fault is due: 12-18 steps into the job for the first one (not just after a
    checkpoint's step); for each
    later one of a chain, once the job has recovered from the one before and trained 5-10 steps
    more. Returns the time the job is watched from (0, or the previous fault's)."""
    if not job.faults:
        # Not right after a checkpoint's step (the scenarios save every 5): a kill there may tear that
        # step's snapshot while the disk holds it, and the restore legitimately comes from the disk.
        job.wait_for_step(rng.choice([step for step in range(12, 19) if step % 5 not in (0, 1)]))
        return 0.0
    since = job.faults[-1][1]
    job.wait_for_recovery(since)
    resumed = [r["step"] for r in job.records() if r["event"] in ("start", "heal") and r["time"] > since]
    due = (resumed[-1] if resumed else 0) + rng.randint(5, 10)
    job.wait_for_step(min(due, _max_steps(job) - LAST_FAULT_MARGIN), after=since)  # still training when it lands
    return since


LAST_FAULT_MARGIN = 8
"""Steps before the job's last at which a chain's fault is due at the latest: a fault that lands on a
job that finished training tests nothing (a stopped worker then holds its peer in the job's end)."""


def _max_steps(job: ChaosJob) -> int:
    args = list(job.spec.script_args)
    return int(args[args.index("--max-steps") + 1]) if "--max-steps" in args else 10**9


def _since(job: ChaosJob) -> float:
    return job.faults[-1][1] if job.faults else 0.0


def _every_node_trains(job: ChaosJob) -> None:
    """Wait until every live node trains again after the previous fault: a step at the full world size
    after the job's last change since that fault (its recovery first; under train-on, the grow that
    takes the replacement back). A step the job logged as the fault struck does not count: a chain's
    next fault must not land while the last one's replacement is still on its way in."""
    since = _since(job)
    if job.faults:
        job.wait_for_recovery(since)
    changes = [r["time"] for r in job.records() if r["event"] in ("start", "heal") and r["time"] > since]
    job.wait_for_world_size(job.live_agents(), after=max(changes, default=since))


def kill_worker(job: ChaosJob, rng: random.Random) -> dict[int, int]:
    # Every live node trains first (with --nnodes 1:3 the second may join late; in a chain under
    # train-on the replacement of the last fault's worker joins later).
    _every_node_trains(job)
    when_due(job, rng)
    job.signal_worker(signal.SIGKILL, rng=rng)
    return {}


def kill_during_save(job: ChaosJob, rng: random.Random, name: str = "kill-during-save") -> dict[int, int]:
    # ELASTIC_FAULT (`scenario_env`) kills rank 0 between writing step 20's files and committing
    # them (in a chain, the first commit of step 20 or later after the faults before it). The fault
    # time is the last event of the group it ended: the second group to start after the fault
    # before it (or, first of a chain, after the job's start) opens with restore, start.
    since = _since(job)

    def restarted() -> list[dict] | None:
        records = job.records()
        starts = [i for i, r in enumerate(records) if r["event"] == "start" and r["time"] > since]
        return records[: starts[1]] if len(starts) > 1 else None

    before = job.poll_for(restarted, 180, "a restart after the fault")
    opening = len(before) - (before[-1]["event"] == "restore")
    job.mark(name, at=before[opening - 1]["time"])
    return {}


def kill_during_snapshot(job: ChaosJob, rng: random.Random) -> dict[int, int]:
    # ELASTIC_FAULT kills rank 1 while it copies step 15's state into shared memory (after the
    # data, before its header): that part must never be loaded.
    return kill_during_save(job, rng, name="kill-during-snapshot")


def node_loss(job: ChaosJob, rng: random.Random) -> dict[int, int]:
    # Both nodes must be in the job before one is lost: on a busy machine the second
    # agent can miss the first round and join through a membership change later.
    _every_node_trains(job)
    when_due(job, rng)
    # Not agent 0: with c10d it hosts the rendezvous store, the one node a c10d job cannot lose.
    lost = job.last_live_agent()
    job.kill_agent(lost)
    return {lost: -signal.SIGKILL}


def scale_up(job: ChaosJob, rng: random.Random) -> dict[int, int]:
    """A node joins the running job (paced so that it outlasts the join: `scenario_env`)."""
    when_due(job, rng)
    job.mark("scale-up")
    job.add_agent()
    return {}


def hang(job: ChaosJob, rng: random.Random) -> dict[int, int]:
    _every_node_trains(job)
    when_due(job, rng)
    job.signal_worker(signal.SIGSTOP, rank=1)
    return {}


def partition(job: ChaosJob, rng: random.Random) -> dict[int, int]:
    """The last agent's host loses its network; the job goes on without it, and takes
    it back once the link returns."""
    when_due(job, rng)
    live = job.live_agents()
    lost = job.last_live_agent()  # not agent 0: with c10d it hosts the rendezvous store
    job.cut_link(lost)
    job.wait_for_world_size(live - 1, after=job.faults[-1][1])
    healed = time.time()
    job.heal_link(lost)
    job.mark("heal", at=healed)
    job.wait_for_world_size(live, after=healed)
    return {}


def etcd_restart(job: ChaosJob, rng: random.Random) -> dict[int, int]:
    """etcd goes down just as the job must rendezvous: a worker is killed while etcd
    is stopped, and etcd comes back (same data) 2 s later. The agents' etcd client
    retries through the outage (`read_timeout`) and the job recovers through it."""
    if job.spec.etcd is None:
        raise ValueError("the etcd-restart scenario needs an etcd the harness started (JobSpec.etcd)")
    when_due(job, rng)
    job.spec.etcd.stop()
    job.mark("etcd-stop")
    job.signal_worker(signal.SIGKILL, rng=rng)
    time.sleep(2)  # the outage itself: what the scenario is about
    job.spec.etcd.start()
    return {}


def soak(job: ChaosJob, rng: random.Random) -> dict[int, int]:
    """Faults on a schedule, in one job: a SIGKILL, a SIGTERM and a SIGSTOP of random
    workers, each once the job has recovered from the one before and trained on."""
    for signum in (signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP):
        when_due(job, rng)
        job.signal_worker(signum, rng=rng)
    return {}


def preemption(job: ChaosJob, rng: random.Random) -> dict[int, int]:
    when_due(job, rng)
    job.signal_worker(signal.SIGTERM, rng=rng)
    return {}


def relaunch(job: ChaosJob, rng: random.Random) -> dict[int, int]:
    """The job's first launch trains a third to a half of the steps and ends (torch
    closes the rendezvous); the job is launched again with the same `--rdzv-id` and
    the full `--max-steps`, and must resume from the first launch's final
    checkpoint. The 'fault' is the relaunch, its recovery the time to the first step.
    (The final weights differ from an uninterrupted run's: the LR schedule follows
    --max-steps.) `run_scenario` leaves the first launch to this scenario
    (`LAUNCHES_ITSELF`)."""
    args = list(job.spec.script_args)
    at = args.index("--max-steps") + 1
    first_steps = rng.randint(int(args[at]) // 3, int(args[at]) // 2)
    job.spec.script_args = [*args[:at], str(first_steps), *args[at + 1 :]]
    job.start()
    codes = job.wait(300)
    if codes != [0] * len(codes):
        raise RuntimeError(f"the first launch ended with exit codes {codes}, not 0:\n{job.logs()}")
    job.mark("relaunch")
    job.relaunch(args)
    return {}


def disk_full(job: ChaosJob, rng: random.Random) -> dict[int, int]:
    """The checkpoint volume is full from step 20 on (`SCENARIO_FAULTS`: every save from
    then on fails with ENOSPC, on every restart). Training goes on past the first
    failures; the third in a row stops every worker with one line and exit 75, the
    step-15 checkpoint intact. Our launcher does not restart it (a restart would
    meet the same disk); stock torchrun restarts until --max-restarts is spent."""
    return dict.fromkeys(range(len(job.agents)), 75 if job.spec.launcher == "ours" else 1)


def slow_storage(job: ChaosJob, rng: random.Random) -> dict[int, int]:
    """Step 10's save and the final one each take 6 s (`SCENARIO_FAULTS`), longer than
    the watchdog (3 s) and the collective timeout (4 s, `SCENARIO_ARGS`): saves due
    meanwhile are skipped, nothing trips, the job finishes without a restart."""
    return {}


SCENARIOS: dict[str, Scenario] = {
    "kill-worker": kill_worker,
    "kill-during-save": kill_during_save,
    "kill-during-snapshot": kill_during_snapshot,
    "node-loss": node_loss,
    "scale-up": scale_up,
    "hang": hang,
    "preemption": preemption,
    "partition": partition,
    "etcd-restart": etcd_restart,
    "soak": soak,
    "relaunch": relaunch,
    "disk-full": disk_full,
    "slow-storage": slow_storage,
}
