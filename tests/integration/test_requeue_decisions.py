"""When a task started by `srun python recipes/gpt.py` requeues its job, and when it must not: with a
fake `scontrol` on PATH that records its calls (the real one is in tests/integration/test_slurm.py).

The task is a one-task Slurm step (Slurm's variables, no torchrun's) that trains paced steps until
it is signalled."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import REPO, free_port, make_text, steps_seen, wait_for, worker_env

from elastic.events import read_events
from elastic.slurm.requeue import noted_commits

pytestmark = pytest.mark.slow

FAKE_SCONTROL = textwrap.dedent("""\
    #!{python}
    import json, os, sys
    with open(os.environ["FAKE_SCONTROL_LOG"], "a") as log:
        log.write(json.dumps(sys.argv[1:]) + "\\n")
    if sys.argv[1:3] == ["show", "job"]:
        print(f"JobId={{sys.argv[-1]}} JobName=gpt Requeue={{os.environ.get('FAKE_REQUEUE', '1')}} Restarts=0")
""")
PACED = "after_step@1+:do=slow:for=0.2:restart=any"


def slurm_task(tmp_path: Path, **extra: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(FAKE_SCONTROL.format(python=sys.executable))
    scontrol.chmod(0o755)
    env = worker_env(
        SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0",
        SLURM_NODEID="0", SLURM_STEP_NODELIST="localhost", SLURM_STEP_TASKS_PER_NODE="1",
        MASTER_PORT=str(free_port()), FAKE_SCONTROL_LOG=str(tmp_path / "scontrol.log"), **extra,
    )
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    return env


@pytest.mark.parametrize(("case", "signum", "extra", "exit_code", "calls", "line"), [
    ("requeue", signal.SIGUSR1, {}, 143, [["show", "job", "-o", "77"], ["requeue", "77"]],
     "Slurm job 77 requeued (scontrol requeue)"),
    ("no --requeue", signal.SIGUSR1, {"FAKE_REQUEUE": "0"}, 143, [["show", "job", "-o", "77"]],
     "Slurm job 77 not requeued: it was submitted without --requeue"),
    ("storage stop", signal.SIGUSR1, {"ELASTIC_FAULT": f"{PACED},during_write@1+:do=enospc"}, 75, [],
     "the preemption checkpoint of step"),
    ("plain SIGTERM", signal.SIGTERM, {}, 143, [], "stopped by SIGTERM after step"),
])
def test_only_a_committed_preemption_by_the_requeue_signal_requeues(
    tmp_path: Path, case: str, signum: int, extra: dict[str, str], exit_code: int, calls: list[list[str]], line: str,
) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_text(random.Random(5), 20_000))
    events = tmp_path / "events.jsonl"
    notes = tmp_path / "notes"  # as an agent gives its workers (elastic.slurm.requeue.note_commit)
    notes.mkdir()
    env = slurm_task(tmp_path, **{"ELASTIC_FAULT": PACED, "TORCHREVIVE_PREEMPTION_NOTES": str(notes), **extra})
    proc = subprocess.Popen(
        [sys.executable, "recipes/gpt.py", "--data", str(corpus), "--max-steps", "500", "--batch-size", "2",
         "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--eval-every", "0",
         "--ckpt-every", "0", "--ckpt-dir", str(tmp_path / "ckpt"), "--events", str(events), "--device", "cpu"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_for(lambda: steps_seen(events) >= 3, 120, f"the task training ({case})")
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == exit_code, err[-3000:]
    log = tmp_path / "scontrol.log"
    made = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    assert made == calls, (made, err[-3000:])
    assert line in err, err[-3000:]
    # Every committed stop is noted, a plain SIGTERM's too: an agent that took the requeue signal first
    # stops its workers with SIGTERM, and requeues on their note.
    committed = [e["step"] for e in read_events(events) if e["event"] == "checkpoint"]
    assert noted_commits(notes) == ([] if exit_code == 75 else committed[-1:]), err[-3000:]
