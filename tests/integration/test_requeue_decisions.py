"""When a task started by `srun python recipes/gpt.py` requeues its job, and when it must not: with a
fake `scontrol` on PATH that records its calls (the real one is in tests/integration/test_slurm.py).

The decision after a committed preemption (elastic._shared.slurm.requeue) is called here directly, once per
answer it can give. Each way a task's stop takes through the recipe runs once for real: a one-task
Slurm step (Slurm's variables, no torchrun's) that trains paced steps until it is signalled."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import warm
from support import REPO, free_port, make_text, steps_seen, wait_for, worker_env

from elastic._shared.slurm.requeue import (
    NOTES_ENV,
    after_preemption_commit,
    note_commit,
    noted_commits,
)
from elastic._worker.observe.events import read_events

FAKE_SCONTROL = """#!/bin/sh
echo "$*" >> "$FAKE_SCONTROL_LOG"
if [ -n "$FAKE_SCONTROL_FAILS" ]; then echo "slurm_load_jobs error: $FAKE_SCONTROL_FAILS" >&2; exit 1; fi
if [ "$1 $2" = "show job" ]; then
  for job; do :; done
  echo "JobId=$job JobName=gpt Requeue=${FAKE_REQUEUE:-1} Restarts=0"
fi
"""
PACED = "after_step@1+:do=slow:for=0.2:restart=any"
REQUEUED = "Slurm job 77 requeued (scontrol requeue); it resumes from this checkpoint"


def fake_scontrol(tmp_path: Path) -> tuple[Path, Path]:
    """(a folder holding the fake `scontrol`, the log of its calls: one line of arguments each)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(FAKE_SCONTROL)
    scontrol.chmod(0o755)
    return bin_dir, tmp_path / "scontrol.log"


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_after_a_committed_preemption_only_rank_0_of_a_job_without_an_agent_requeues_and_only_if_it_may(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    bin_dir, log = fake_scontrol(tmp_path)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SCONTROL_LOG", str(log))
    said = "after step 5; checkpoint committed in /ckpt"

    def decide(**given: int | bool | None) -> tuple[str, list[str]]:
        log.unlink(missing_ok=True)
        return after_preemption_commit(said=said, **given), calls(log)  # type: ignore[arg-type]

    caplog.set_level(logging.WARNING, logger="elastic._shared.slurm.requeue")
    assert decide(rank=0, job_id=77, committed=True) == (f"; {REQUEUED}", ["show job -o 77", "requeue 77"])
    # the line is logged at once (the requeue's SIGTERM may end the process before its exit line)
    assert f"stopped {said}; {REQUEUED}" in caplog.messages
    monkeypatch.setenv("FAKE_REQUEUE", "0")
    assert decide(rank=0, job_id=77, committed=True) == (
        "; Slurm job 77 not requeued: it was submitted without --requeue", ["show job -o 77"])
    monkeypatch.setenv("FAKE_SCONTROL_FAILS", "controller down")
    line, made = decide(rank=0, job_id=77, committed=True)
    assert line == "; Slurm job 77 not requeued: scontrol show job -o 77 failed: slurm_load_jobs error: controller down"
    assert made == ["show job -o 77"]
    monkeypatch.delenv("FAKE_SCONTROL_FAILS")
    monkeypatch.delenv("FAKE_REQUEUE")
    # no checkpoint: a requeued run would start over
    assert decide(rank=0, job_id=77, committed=False) == (
        "; Slurm job 77 not requeued: with no --ckpt-dir a requeued run would start over", [])
    assert decide(rank=1, job_id=77, committed=True) == ("", [])  # not rank 0
    assert decide(rank=0, job_id=None, committed=True) == ("", [])  # under an agent: the agent requeues


def test_a_worker_notes_its_commit_for_its_agent_only_where_the_agent_asked(tmp_path: Path) -> None:
    notes = tmp_path / "notes"
    notes.mkdir()
    note_commit({}, rank=0, step=3)  # no agent: nothing to note
    assert noted_commits(notes) == []
    note_commit({NOTES_ENV: str(notes)}, rank=1, step=17)
    note_commit({NOTES_ENV: str(notes)}, rank=0, step=17)
    (notes / "rank-2").write_text("not a step")
    assert sorted(noted_commits(notes)) == [17, 17]
    assert sorted(p.name for p in notes.iterdir()) == ["rank-0", "rank-1", "rank-2"]  # no temporary left


@pytest.mark.slow
def test_only_a_committed_preemption_by_the_requeue_signal_requeues(tmp_path: Path) -> None:
    """Three tasks at once, each stopped its own way: the requeue signal (a committed stop: requeued),
    the requeue signal when the preemption checkpoint cannot be written (exit 75, never requeued),
    and a plain SIGTERM (committed, never requeued). Every committed stop is noted, a plain SIGTERM's
    too: an agent that took the requeue signal first stops its workers with SIGTERM, and requeues
    on their note."""
    cases = {  # name: (signal, extra environment, exit code, scontrol calls, a line of its stderr)
        "requeue": (signal.SIGUSR1, {}, 143, ["show job -o 77", "requeue 77"], REQUEUED),
        "storage stop": (signal.SIGUSR1, {"ELASTIC_FAULT": f"{PACED},during_write@1+:do=enospc"}, 75, [],
                         "the preemption checkpoint of step"),
        "plain SIGTERM": (signal.SIGTERM, {}, 143, [], "stopped by SIGTERM after step"),
    }
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_text(random.Random(5), 20_000))
    procs: dict[str, warm.WarmProcess] = {}
    try:
        for name, (_, extra, *_) in cases.items():
            procs[name] = start_task(tmp_path / name.replace(" ", "-"), corpus, **extra)
        for name, (signum, *_) in cases.items():
            events = tmp_path / name.replace(" ", "-") / "events.jsonl"
            wait_for(lambda: steps_seen(events) >= 3, 120, f"the task training ({name})")  # noqa: B023
            procs[name].send_signal(signum)
        for proc in procs.values():
            proc.wait(timeout=120)
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    for name, (_, _, exit_code, made, line) in cases.items():
        where = tmp_path / name.replace(" ", "-")
        err = (where / "stderr.log").read_text(errors="replace")
        assert procs[name].returncode == exit_code, (name, err[-3000:])
        assert calls(where / "scontrol.log") == made, (name, err[-3000:])
        assert line in err, (name, err[-3000:])
        committed = [e["step"] for e in read_events(where / "events.jsonl") if e["event"] == "checkpoint"]
        assert noted_commits(where / "notes") == ([] if exit_code == 75 else committed[-1:]), (name, err[-3000:])


def start_task(where: Path, corpus: Path, **extra: str) -> warm.WarmProcess:
    """The recipe as the one task of Slurm job 77's step 0, in `where` (a fake scontrol, its notes folder
    as an agent gives its workers: elastic._shared.slurm.requeue.note_commit), paced unless `extra` says otherwise.
    Forked warm (tests/warm.py: torch imported once), as `python recipes/gpt.py` with that environment."""
    where.mkdir()
    bin_dir, log = fake_scontrol(where)
    (where / "notes").mkdir()
    env = worker_env(
        SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0",
        SLURM_NODEID="0", SLURM_STEP_NODELIST="localhost", SLURM_STEP_TASKS_PER_NODE="1",
        MASTER_PORT=str(free_port()), FAKE_SCONTROL_LOG=str(log), TORCHREVIVE_PREEMPTION_NOTES=str(where / "notes"),
        **{"ELASTIC_FAULT": PACED, **extra},
    )
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    with (where / "stderr.log").open("w") as stderr:
        return warm.start(
            [sys.executable, "recipes/gpt.py", "--data", str(corpus), "--max-steps", "500", "--batch-size", "2",
             "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--eval-every", "0",
             "--ckpt-every", "0", "--ckpt-dir", str(where / "ckpt"), "--events", str(where / "events.jsonl"),
             "--device", "cpu"],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
        )
