"""The chaos scenarios: each starts a job (harness.ChaosJob), hurts it once training is under way,
waits for the end and judges it (`run_scenario` -> harness.ScenarioResult).

`SCENARIOS` names them; the tables below say what each needs (agents on hosts
of their own, an etcd the harness started), how long its job trains, which
faults its workers inject themselves (ELASTIC_FAULT) and what it may cost.
"""

from __future__ import annotations

import random
import signal
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from elastic.chaos.etcd import EtcdServer
from elastic.chaos.harness import (
    ChaosJob,
    JobSpec,
    ScenarioResult,
    draw_report,
    find_recipe,
    verified_final_checkpoint,
)
from elastic.chaos.netns import VirtualNetwork
from elastic.chaos.samples import audit, kept_processes
from elastic.heal_env import FROZEN_AFTER_ENV, RESTART, SURVIVORS_ENV, TRAIN_ON

Scenario = Callable[[ChaosJob, random.Random], list[int | None]]
"""Hurts a started job; returns the exit codes expected of its agents."""


def kill_worker(job: ChaosJob, rng: random.Random) -> list[int | None]:
    job.wait_for_world_size(len(job.agents), after=0.0)  # (with --nnodes 1:3, the second may join late)
    job.wait_for_step(rng.randint(12, 18))
    job.signal_worker(signal.SIGKILL, rng=rng)
    return [0] * len(job.agents)


def kill_during_save(job: ChaosJob, rng: random.Random, name: str = "kill-during-save") -> list[int | None]:
    # ELASTIC_FAULT=before_commit@20 (set by `scenario_env`) kills rank 0 between
    # writing step 20's files and committing them; the fault time is the last
    # event of the first group (the restarted group opens with restore, start).
    deadline = time.monotonic() + 180
    while not job.restart_times():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the job never restarted after the fault:\n{job.logs()}")
        time.sleep(0.05)
    records = job.records()
    second_start = [i for i, r in enumerate(records) if r["event"] == "start"][1]
    opening = second_start - (records[second_start - 1]["event"] == "restore")
    job.mark(name, at=records[opening - 1]["time"])
    return [0] * len(job.agents)


def kill_during_snapshot(job: ChaosJob, rng: random.Random) -> list[int | None]:
    # ELASTIC_FAULT=during_snapshot@15:rank=1 kills rank 1 while it copies step 15's state into
    # shared memory (after the data, before its header): that part must never be loaded.
    return kill_during_save(job, rng, name="kill-during-snapshot")


def node_loss(job: ChaosJob, rng: random.Random) -> list[int | None]:
    # Both nodes must be in the job before one is lost: on a busy machine the second
    # agent can miss the first round and join through a membership change later.
    job.wait_for_world_size(2, after=0.0)
    job.wait_for_step(rng.randint(12, 18))
    # Not agent 0: with c10d it hosts the rendezvous store, the one node a c10d job cannot lose.
    job.kill_agent(len(job.agents) - 1)
    return [0] * (len(job.agents) - 1) + [-signal.SIGKILL]


def scale_up(job: ChaosJob, rng: random.Random) -> list[int | None]:
    """A node joins the running job (paced so that it outlasts the join: SCENARIO_FAULTS)."""
    job.wait_for_step(rng.randint(12, 18))
    job.mark("scale-up")
    job.add_agent()
    return [0] * len(job.agents)


def hang(job: ChaosJob, rng: random.Random) -> list[int | None]:
    job.wait_for_world_size(len(job.agents), after=0.0)
    job.wait_for_step(rng.randint(12, 18))
    job.signal_worker(signal.SIGSTOP, rank=1)
    return [0] * len(job.agents)


def partition(job: ChaosJob, rng: random.Random) -> list[int | None]:
    """The last agent's host loses its network; the job goes on without it, and takes
    it back once the link returns."""
    job.wait_for_step(rng.randint(12, 18))
    lost = len(job.agents) - 1  # not agent 0: with c10d it hosts the rendezvous store
    job.cut_link(lost)
    job.wait_for_world_size(len(job.agents) - 1, after=job.faults[-1][1])
    healed = time.time()
    job.heal_link(lost)
    job.mark("heal", at=healed)
    job.wait_for_world_size(len(job.agents), after=healed)
    return [0] * len(job.agents)


def etcd_restart(job: ChaosJob, rng: random.Random) -> list[int | None]:
    """etcd goes down just as the job must rendezvous: a worker is killed while etcd
    is stopped, and etcd comes back (same data) 2 s later. The agents' etcd client
    retries through the outage (`read_timeout`) and the job recovers through it."""
    if job.spec.etcd is None:
        raise ValueError("the etcd-restart scenario needs an etcd the harness started (JobSpec.etcd)")
    job.wait_for_step(rng.randint(12, 18))
    job.spec.etcd.stop()
    job.mark("etcd-stop")
    job.signal_worker(signal.SIGKILL, rng=rng)
    time.sleep(2)
    job.spec.etcd.start()
    return [0] * len(job.agents)


def soak(job: ChaosJob, rng: random.Random) -> list[int | None]:
    """Faults on a schedule, in one job: a SIGKILL, a SIGTERM and a SIGSTOP of random
    workers, each once the job has recovered from the one before and trained on."""
    since = 0.0
    for signum in (signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP):
        started = [r for r in job.records() if r["event"] == "start" and r["time"] > since]
        job.wait_for_step((started[-1]["step"] if started else 0) + rng.randint(5, 10), after=since)
        job.signal_worker(signum, rng=rng)
        since = job.faults[-1][1]
        job.wait_for_recovery(since)
    return [0] * len(job.agents)


def preemption(job: ChaosJob, rng: random.Random) -> list[int | None]:
    job.wait_for_step(rng.randint(12, 18))
    job.signal_worker(signal.SIGTERM, rng=rng)
    return [0] * len(job.agents)


def relaunch(job: ChaosJob, rng: random.Random) -> list[int | None]:
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
    return [0] * len(job.agents)


def disk_full(job: ChaosJob, rng: random.Random) -> list[int | None]:
    """The checkpoint volume is full from step 20 on (`SCENARIO_FAULTS`: every save from
    then on fails with ENOSPC, on every restart). Training goes on past the first
    failures; the third in a row stops every worker with one line and exit 75, the
    step-15 checkpoint intact. Our launcher does not restart it (a restart would
    meet the same disk); stock torchrun restarts until --max-restarts is spent."""
    return [75 if job.spec.launcher == "ours" else 1] * len(job.agents)


def slow_storage(job: ChaosJob, rng: random.Random) -> list[int | None]:
    """Step 10's save and the final one each take 8 s (`SCENARIO_FAULTS`), longer than
    the watchdog (3 s) and the collective timeout (4 s, `SCENARIO_ARGS`): saves due
    meanwhile are skipped, nothing trips, the job finishes without a restart."""
    return [0] * len(job.agents)


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
NEEDS_NETWORK = {"partition"}
"""Scenarios that need agents on hosts of their own (network namespaces)."""
NEEDS_OWN_ETCD = {"etcd-restart"}
"""Scenarios that need the etcd-v3 backend on an etcd the harness started."""
LAUNCHES_ITSELF = {"relaunch"}
"""Scenarios that start the job themselves (with arguments of their own)."""


# Scenarios that change the world size need the job to outlast a new round
# (a joining agent first imports torch): they train longer.
SCENARIO_STEPS = {"scale-up": 250, "node-loss": 400, "partition": 800, "soak": 300}
# Jobs whose world size must stay 2 wait for both agents before the first round
# (with a minimum of 1, the first agent could train alone until the second joins).
SCENARIO_NNODES = {"scale-up": "1:3", "node-loss": "1:3", "partition": "1:3"}


# Faults the workers inject themselves (elastic.chaos.faults), per scenario.
SCENARIO_FAULTS = {
    "kill-during-save": "before_commit@20",
    "kill-during-snapshot": "during_snapshot@15:rank=1",
    "disk-full": "during_write@20+:do=enospc:restart=any",
    "slow-storage": "during_write@10:do=slow:for=8,during_write@40:do=slow:for=8",
    # The job must outlast the new node's cold start (Python, torch, its agent's fork server),
    # however loaded the machine: rank 0 paces every step to at least 0.3 s (a sleep: load does
    # not speed the job up), so its 250 steps take 75 s or more (a join took 11 s at load 5 and
    # over 25 s at load 16, on 2 cores). Only the first launch is paced (restart 0): once the
    # node has joined, the job runs at full speed, so the headroom costs nothing when it is unused.
    "scale-up": "after_step@1+:do=slow:for=0.3",
}
# Recipe flags a scenario adds to the common ones.
SCENARIO_ARGS = {"slow-storage": ["--collective-timeout", "4"]}
# Scenarios whose job must stop instead of finishing: the step of the newest
# checkpoint that must be left intact.
SCENARIO_STOPS_AT = {"disk-full": 15}


# Under our launcher (in-memory snapshots every step: the harness asks for them) a fault costs at most this many
# finished steps (the restore events' `redone`).
SCENARIO_MAX_REDONE = {"kill-worker": 1, "kill-during-snapshot": 1, "node-loss": 1, "preemption": 1}


# With TORCHREVIVE_SURVIVORS=keep or train-on, a fault of one worker or one node stops no other worker:
# the scenarios that hurt one, and how many workers must keep their processes through it (of 2 agents).
SURVIVOR_SCENARIOS = {"kill-worker": 1, "hang": 1, "node-loss": 1}


def scenario_env(name: str, survivors: str = RESTART) -> dict[str, str]:
    env = {"ELASTIC_FAULT": SCENARIO_FAULTS[name]} if name in SCENARIO_FAULTS else {}
    if survivors != RESTART:  # a stopped worker is ended after 1 s (of the watchdog's 3 s): its peers keep theirs
        env.update({SURVIVORS_ENV: survivors, FROZEN_AFTER_ENV: "1"})
    return env


def run_scenario(
    name: str,
    workdir: Path,
    data: Path,
    *,
    steps: int | None = None,
    backend: str = "c10d",
    endpoint: str | None = None,
    launcher: str = "ours",
    seed: int = 0,
    model_args: Sequence[str] = ("--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--batch-size", "8"),
    recipe_args: Sequence[str] = (),
    timeout: float = 300,
    network: VirtualNetwork | None = None,
    etcd: EtcdServer | None = None,
    recipe: Path | None = None,
    survivors: str = RESTART,
) -> ScenarioResult:
    """Run one scenario to the end and judge it. With a `network` each agent runs on
    a host of its own; with `etcd` (a started member) an etcd-v3 job uses it, and
    may restart it. The caller owns both and closes them. `recipe_args` go to the
    recipe after the harness's own flags (e.g. `["--fsdp"]`: the model sharded with FSDP2);
    `recipe` is the GPT recipe (default: `find_recipe()`); `survivors`: TORCHREVIVE_SURVIVORS for the
    agents (with `keep` or `train-on`, the workers a fault does not hit must keep their processes:
    `SURVIVOR_SCENARIOS`)."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
    if name in NEEDS_NETWORK and network is None:
        raise ValueError(f"the {name} scenario needs agents on hosts of their own (a network of namespaces)")
    if name in NEEDS_OWN_ETCD and (etcd is None or backend != "etcd-v3"):
        raise ValueError(f"the {name} scenario needs the etcd-v3 backend on an etcd the harness started")
    if etcd is not None and endpoint is None:
        endpoint = f"{network.gateway}:{etcd.port}" if network else etcd.endpoint
    rng = random.Random(seed)
    steps = steps or SCENARIO_STEPS.get(name, 40)
    ckpt = workdir / "ckpt"
    spec = JobSpec(
        workdir=workdir, backend=backend, endpoint=endpoint, launcher=launcher,
        # Survivors that train on may go down to one node: the job's minimum must allow it.
        nnodes="1:3" if survivors == TRAIN_ON else SCENARIO_NNODES.get(name, "2:3"),
        run_id=f"chaos-{name}-{uuid.uuid4().hex[:8]}",  # several jobs may share one etcd
        script_args=[
            "--data", str(data), "--max-steps", str(steps), "--eval-every", "0", "--ckpt-dir", str(ckpt),
            "--ckpt-every", "5", "--hang-timeout", "3", "--dropout", "0.1",
            # Snapshots every step, not the default auto interval: the suite proves their promise,
            # at most one finished step redone per fault (SCENARIO_MAX_REDONE).
            "--snapshot-every", "1", *model_args,
            *SCENARIO_ARGS.get(name, []), *recipe_args,
        ],
        env=scenario_env(name, survivors), sample_log=workdir / "samples", network=network, etcd=etcd,
        script=recipe or find_recipe(),
    )
    with ChaosJob(spec) as job:
        if name not in LAUNCHES_ITSELF:
            job.start()
        expected = SCENARIOS[name](job, rng)
        codes = job.wait(timeout)
        ends = [r["step"] for r in job.records() if r["event"] == "end"]
        stops_at = SCENARIO_STOPS_AT.get(name)
        final_step = steps if stops_at is None else stops_at
        final, error = verified_final_checkpoint(ckpt, final_step) if ckpt.is_dir() else (None, "no checkpoint directory")
        if ckpt.is_dir() and any(p.name.startswith(".tmp.") for p in ckpt.iterdir()):
            final, error = None, f"a failed save left its temporary directory in {ckpt}"
        return ScenarioResult(
            scenario=name,
            exit_codes=codes,
            expected_codes=expected,
            end_step=ends[-1] if ends else None,
            max_steps=steps,
            recovery_seconds=[job.recovery_seconds(t) for _, t in job.faults],
            final_checkpoint=final,
            checkpoint_error=error,
            samples=audit(workdir / "samples"),
            stops_at=stops_at,
            redone=[r["redone"] for r in job.records() if r["event"] == "restore" and r.get("restart", 0) > 0 and "redone" in r],
            max_redone=SCENARIO_MAX_REDONE.get(name) if launcher == "ours" else None,
            logs=job.logs(),
            kept_processes=kept_processes(workdir / "samples", job.faults[0][1]) if job.faults else 0,
            min_kept=SURVIVOR_SCENARIOS.get(name) if survivors != RESTART else None,
            report=draw_report(job.events_path, workdir / "report.png", title=f"chaos: {name} ({' '.join([backend, *recipe_args])})"),
        )
