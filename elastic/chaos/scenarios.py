"""The chaos scenarios: each starts a job (harness.ChaosJob), hurts it once training is under way,
waits for the end and judges it (`run_scenario` -> verdict.ScenarioResult).

`SCENARIOS` (strikes.py) names them and says how each hurts the job; the tables
below say what each needs (agents on hosts of their own, an etcd the harness
started), how long its job trains, which faults its workers inject themselves
(ELASTIC_FAULT) and what it may cost.

Several scenarios can share one job, a chain (`node-loss+scale-up`): each
fault strikes once the job has recovered from the one before and trained a
few steps more, and the job is judged on all of them. A chain costs one job's
start, rendezvous and reference run instead of one per fault, and shows what a
single fault cannot: recoveries that follow each other.
"""

from __future__ import annotations

import random
import subprocess
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from elastic._shared.common.errors import UsageError
from elastic._shared.protocol.heal_env import (
    FROZEN_AFTER_ENV,
    RESTART,
    SURVIVORS_ENV,
    TRAIN_ON,
)
from elastic.chaos.etcd import EtcdServer
from elastic.chaos.faults import ONCE_DIR_ENV
from elastic.chaos.harness import ChaosJob
from elastic.chaos.job_spec import JobSpec, find_recipe
from elastic.chaos.netns import VirtualNetwork
from elastic.chaos.samples import audit, kept_processes
from elastic.chaos.strikes import SCENARIOS
from elastic.chaos.verdict import ScenarioResult, draw_report, verified_final_checkpoint


NEEDS_NETWORK = {"partition"}
"""Scenarios that need agents on hosts of their own (network namespaces)."""
NEEDS_OWN_ETCD = {"etcd-restart"}
"""Scenarios that need the etcd-v3 backend on an etcd the harness started."""
LAUNCHES_ITSELF = {"relaunch"}
"""Scenarios that start the job themselves (with arguments of their own)."""


ALONE = {"disk-full", "slow-storage", "relaunch"}
"""Scenarios that cannot share a job with others: the job stops (disk-full), must see no restart
(slow-storage), or is launched by the scenario itself (relaunch)."""


# Scenarios that change the world size need the job to outlast a new round
# (a joining agent first imports torch): they train longer, and `scenario_env` paces them.
SCENARIO_STEPS = {"scale-up": 200, "node-loss": 100, "partition": 200, "soak": 300}
# Jobs whose world size must stay 2 wait for both agents before the first round
# (with a minimum of 1, the first agent could train alone until the second joins).
SCENARIO_NNODES = {"scale-up": "1:3", "node-loss": "1:3", "partition": "1:3"}


# Faults the workers inject themselves (elastic.chaos.faults), per scenario. `{step}` is where the
# fault fires: its default here, later in a chain (`chain_env`); `once`: in the first worker to get
# there, whichever attempt that is (a chain's earlier faults restart the workers).
SCENARIO_FAULTS = {
    "kill-during-save": "before_commit@{step}+:restart=any:once",
    "kill-during-snapshot": "during_snapshot@{step}+:rank=1:restart=any:once",
    "disk-full": "during_write@20+:do=enospc:restart=any",
    "slow-storage": "during_write@10:do=slow:for=6,during_write@40:do=slow:for=6",
}
FAULT_STEPS = {"kill-during-save": 20, "kill-during-snapshot": 15}
"""The step at or after which a worker-injected fault of a chain fires, unless a fault before it is later."""
PACED = "after_step@1+:do=slow:for={seconds}:restart=any:world={world}"
"""Rank 0 paces every step at `world` to at least `seconds`. A job that must outlast a node joining it, however loaded the machine (a join took 11 s at
load 5 and over 25 s at load 16, on 2 cores: Python, torch, its agent's fork server), has rank 0
pace every step to at least 0.3 s while it trains at the world size before the join (a sleep:
load does not speed the job up). Once the node has joined, the job runs at full speed, so the
headroom costs nothing when it is unused."""
SOAK_PACE = 0.1
"""The soak's three faults follow each other within a short job (the suite's 60 steps): rank 0 paces every
step to at least 0.1 s, so a loaded machine's slower harness (it polls the event log) still lands each
fault while the job trains, at most a few steps after it was due. A sleep changes no number."""
# Recipe flags a scenario adds to the common ones.
SCENARIO_ARGS = {"slow-storage": ["--collective-timeout", "4"]}
# Scenarios whose job must stop instead of finishing: the step of the newest
# checkpoint that must be left intact.
SCENARIO_STOPS_AT = {"disk-full": 15}


# Under our launcher (in-memory snapshots every step: the harness asks for them) a fault costs at most this many
# finished steps (the restore events' `redone`).
SCENARIO_MAX_REDONE = {"kill-worker": 1, "kill-during-snapshot": 1, "node-loss": 1, "preemption": 1, "soak": 1}


# With TORCHREVIVE_SURVIVORS=keep or train-on, a fault of one worker or one node stops no other worker:
# the scenarios that hurt one, and how many workers must keep their processes through it (of 2 agents).
SURVIVOR_SCENARIOS = {"kill-worker": 1, "hang": 1, "node-loss": 1}


def parse_chain(text: str | Sequence[str]) -> list[str]:
    """The scenarios of one job, in order: `kill-worker` or `node-loss+scale-up` (or a list). Each
    fault strikes once the job recovered from the one before. Raises `UsageError` (one line) for
    an unknown name, a scenario that needs a job of its own (`ALONE`), or a worker-injected fault
    after one from outside (the workers' own fire by step, so they must come first)."""
    names = [n.strip() for n in text.split("+")] if isinstance(text, str) else list(text)
    for name in names:
        if name not in SCENARIOS:
            raise UsageError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
    if len(names) > 1 and ALONE.intersection(names):
        raise UsageError(f"{'+'.join(names)}: {', '.join(sorted(ALONE.intersection(names)))} needs a job of its own")
    inside = [i for i, n in enumerate(names) if n in FAULT_STEPS]
    if inside and inside != list(range(len(inside))):
        raise UsageError(f"{'+'.join(names)}: faults the workers inject ({', '.join(FAULT_STEPS)}) must come first")
    return names


def chain_env(names: Sequence[str], agents: int, survivors: str = RESTART) -> dict[str, str]:
    """ELASTIC_FAULT and the survivors' settings for a job of `agents` agents that goes through `names`."""
    faults: list[str] = []
    step = 0
    live = agents
    for name in names:
        if name in FAULT_STEPS:
            step = max(FAULT_STEPS[name], step + 5)
            faults.append(SCENARIO_FAULTS[name].format(step=step))
        elif name in SCENARIO_FAULTS:
            faults.append(SCENARIO_FAULTS[name])
        if name == "scale-up":
            faults.append(PACED.format(seconds=0.3, world=live))  # until the new node is in
        elif name == "partition":
            faults.append(PACED.format(seconds=0.3, world=live - 1))  # until the cut-off node is back
        elif name == "node-loss":
            live -= 1
        elif name == "soak":
            faults.append(PACED.format(seconds=SOAK_PACE, world=live))  # three faults one after another within its steps
    env = {"ELASTIC_FAULT": ",".join(dict.fromkeys(faults))} if faults else {}
    if survivors != RESTART:  # a stopped worker is ended after 1 s (of the watchdog's 3 s): its peers keep theirs
        env.update({SURVIVORS_ENV: survivors, FROZEN_AFTER_ENV: "1"})
    return env


def run_scenario(
    name: str | Sequence[str],
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
    start_process: Callable[..., Any] = subprocess.Popen,
) -> ScenarioResult:
    """Run one scenario, or a chain of them in one job (`parse_chain`), to the end and judge it.
    With a `network` each agent runs on a host of its own; with `etcd` (a started member) an
    etcd-v3 job uses it, and may restart it. The caller owns both and closes them. `recipe_args`
    go to the recipe after the harness's own flags (e.g. `["--fsdp"]`: the model sharded with
    FSDP2); `recipe` is the GPT recipe (default: `find_recipe()`); `survivors`:
    TORCHREVIVE_SURVIVORS for the agents (with `keep` or `train-on`, the workers a fault does not
    hit must keep their processes: `SURVIVOR_SCENARIOS`); `start_process`: how agents start
    (`JobSpec.start_process`)."""
    names = parse_chain(name)
    if NEEDS_NETWORK.intersection(names) and network is None:
        raise ValueError(f"the {'+'.join(names)} scenario needs agents on hosts of their own (a network of namespaces)")
    if NEEDS_OWN_ETCD.intersection(names) and (etcd is None or backend != "etcd-v3"):
        raise ValueError(f"the {'+'.join(names)} scenario needs the etcd-v3 backend on an etcd the harness started")
    if etcd is not None and endpoint is None:
        endpoint = f"{network.gateway}:{etcd.port}" if network else etcd.endpoint
    rng = random.Random(seed)
    steps = steps or max(SCENARIO_STEPS.get(n, 40) for n in names) + 30 * (len(names) - 1)
    resizes = [n for n in names if n in SCENARIO_NNODES]
    ckpt = workdir / "ckpt"
    spec = JobSpec(
        workdir=workdir, backend=backend, endpoint=endpoint, launcher=launcher,
        # Survivors that train on may go down to one node: the job's minimum must allow it.
        nnodes="1:3" if survivors == TRAIN_ON or resizes else "2:3",
        run_id=f"chaos-{names[0]}-{uuid.uuid4().hex[:8]}",  # several jobs may share one etcd
        script_args=[
            "--data", str(data), "--max-steps", str(steps), "--eval-every", "0", "--ckpt-dir", str(ckpt),
            "--ckpt-every", "5", "--hang-timeout", "3", "--dropout", "0.1",
            # Snapshots every step, not the default auto interval: the suite proves their promise,
            # at most one finished step redone per fault (SCENARIO_MAX_REDONE).
            "--snapshot-every", "1", *model_args,
            *(arg for n in names for arg in SCENARIO_ARGS.get(n, [])), *recipe_args,
        ],
        env={**chain_env(names, 2, survivors), ONCE_DIR_ENV: str(workdir / "fault-marks")},
        sample_log=workdir / "samples", network=network, etcd=etcd, script=recipe or find_recipe(),
        start_process=start_process,
    )
    (workdir / "fault-marks").mkdir(parents=True, exist_ok=True)
    with ChaosJob(spec) as job:
        if not LAUNCHES_ITSELF.intersection(names):
            job.start()
        expected: dict[int, int] = {}
        for scenario in names:
            for agent, code in SCENARIOS[scenario](job, rng).items():
                if not expected.get(agent):  # a node once lost stays lost
                    expected[agent] = code
        codes = job.wait(timeout)
        ends = [r["step"] for r in job.records() if r["event"] == "end"]
        stops_at = next((SCENARIO_STOPS_AT[n] for n in names if n in SCENARIO_STOPS_AT), None)
        final_step = steps if stops_at is None else stops_at
        final, error = verified_final_checkpoint(ckpt, final_step) if ckpt.is_dir() else (None, "no checkpoint directory")
        if ckpt.is_dir() and any(p.name.startswith(".tmp.") for p in ckpt.iterdir()):
            final, error = None, f"a failed save left its temporary directory in {ckpt}"
        fault_times = [t for _, t in job.faults]
        judged = launcher == "ours" and all(n in SCENARIO_MAX_REDONE for n in names)
        kept_judged = survivors != RESTART and all(n in SURVIVOR_SCENARIOS for n in names)
        return ScenarioResult(
            scenario="+".join(names),
            exit_codes=codes,
            expected_codes=[expected.get(i, 0) for i in range(len(job.agents))],
            end_step=ends[-1] if ends else None,
            max_steps=steps,
            recovery_seconds=[job.recovery_seconds(t) for t in fault_times],
            final_checkpoint=final,
            checkpoint_error=error,
            samples=audit(workdir / "samples"),
            stops_at=stops_at,
            redone=[r["redone"] for r in job.records() if r["event"] == "restore" and r.get("restart", 0) > 0 and "redone" in r],
            max_redone=max(SCENARIO_MAX_REDONE[n] for n in names) if judged else None,
            logs=job.logs(),
            kept_processes=min(
                (kept_processes(workdir / "samples", t, until) for t, until in zip(fault_times, [*fault_times[1:], float("inf")])),
                default=0,
            ),
            min_kept=max(SURVIVOR_SCENARIOS[n] for n in names) if kept_judged else None,
            report=draw_report(job.events_path, workdir / "report.png", title=f"chaos: {'+'.join(names)} ({' '.join([backend, *recipe_args])})"),
        )
