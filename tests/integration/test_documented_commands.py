"""Every `torchrevive-run` command in README.md and docs/*.md recovers from a kill as written.

The commands are read from the pages (the code blocks' and code spans' lines that launch a script; a
span that only names a flag, `torchrevive-run --help`, is no command) and sorted by shape. One job per
shape this machine can run, at its smallest size, with one kill; each other shape names the test that
kills a job of it (the shape's own servers: etcd, Slurm, a bucket, several agents). A command of a
shape not listed here fails the first test: a new shape needs a job, or a test that covers it.

| shape | pages | here |
|---|---|---|
| `--standalone` | README (the tutorial, hf_trainer), metrics.md, results.md | the README's tutorial line, killed at an epoch's last step |
| a range of nodes on c10d | README's quick start, recovery.md, recipes.md, huggingface.md | huggingface.md's line: no `--rdzv-backend`, no `--max-restarts` |
| `--survivors` | recovery.md | tests/chaos/test_scenarios.py |
| etcd-v3 | etcd.md, kubernetes.md | tests/chaos/test_scenarios.py (test_etcd_v3: a worker killed) |
| Slurm | slurm.md | tests/integration/test_slurm.py |
| a bucket (`s3://`) | object-storage.md | tests/integration/test_object_store_jobs.py |

Both jobs run the tutorial (recipes/tutorial.py) on a small data set: each documented line as written,
its placeholders filled (HOST, a port, the script), `--nproc-per-node` at its smallest, plus the
recipe's size flags. No `--max-restarts` is added: the launcher's default must restart. The first job
(2 workers, one node) asserts what a kill of one of several workers of a node must show: the run ends
bit-identical to an uninterrupted one although the kill came at an epoch's last step, after its
checkpoint and during its evaluation (which the resumed run skips: the evaluation drew from every
random stream); only the killed worker's failure is primary in the events (the survivor's, if posted,
is not); and the survivor printed neither a traceback nor a preemption message.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
from references import References
from support import (
    REPO,
    assert_same_tensors,
    checkpoint_tensors,
    free_port,
    logs,
    start_agents,
    steps_seen,
    stop_all,
    wait_all,
    wait_for,
    worker_env,
)

from elastic._agent.launcher.proctree import descendants, worker_rank
from elastic._worker.checkpoint import CheckpointStore
from elastic._worker.observe.events import read_events

pytestmark = pytest.mark.slow

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TUTORIAL = REPO / "recipes" / "tutorial.py"
POINTS, BATCH, EPOCHS = 320, 16, 4  # 280 training points at 16 a rank: 9 steps an epoch at 2 ranks
STEPS = -(-EPOCHS * (POINTS - POINTS // 8) // (2 * BATCH))
SIZE = ["--epochs", str(EPOCHS), "--batch-size", str(BATCH), "--workers", "2", "--device", "cpu"]
"""The tutorial's size flags, as tests/integration/test_tutorial.py runs it (one reference run for both)."""

SHAPES = {  # shape -> the test that kills a job of it, or None: a job here
    "standalone": None,
    "c10d range": None,
    "survivors": REPO / "tests" / "chaos" / "test_scenarios.py",
    "etcd-v3": REPO / "tests" / "chaos" / "test_scenarios.py",  # test_etcd_v3: kill-worker on etcd-v3
    "slurm": REPO / "tests" / "integration" / "test_slurm.py",
    "bucket": REPO / "tests" / "integration" / "test_object_store_jobs.py",
}


def documented_commands() -> list[tuple[str, str]]:
    """(page, command) for each `torchrevive-run` line of the pages that launches a script."""
    found: dict[tuple[str, str], None] = {}
    for page in PAGES:
        text = page.read_text().replace("\\\n", " ")
        fenced = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
        indented = re.findall(r"^(?: {4}|\t)(.*)$", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M)
        for block in [*fenced, *indented, *re.findall(r"`([^`\n]+)`", text)]:
            for line in block.splitlines():
                at = line.find("torchrevive-run ")
                if at >= 0:
                    command = " ".join(line[at:].split())
                    if re.search(r"\S+\.py\b|\s-m\s", command):
                        found[(page.name, command)] = None
    return list(found)


def shape(command: str) -> str:
    if "--survivors" in command:
        return "survivors"
    if "etcd-v3" in command:
        return "etcd-v3"
    if "--rdzv-endpoint=slurm" in command:
        return "slurm"
    if "s3://" in command:
        return "bucket"
    if "--standalone" in command:
        return "standalone"
    if re.search(r"--nnodes=\d+:\d+", command) and "--rdzv-endpoint=" in command:
        return "c10d range"
    return "unknown"


def test_every_documented_command_has_a_shape_and_each_shape_a_job() -> None:
    commands = documented_commands()
    assert len(commands) >= 8, commands
    unknown = [c for c in commands if shape(c[1]) not in SHAPES]
    assert not unknown, f"a command of a new shape: give it a job here, or name the test that kills one: {unknown}"
    assert {shape(c) for _, c in commands} == set(SHAPES), "a shape no page shows any more"
    for covered_by in filter(None, SHAPES.values()):
        assert covered_by.exists(), covered_by


def the_line(page: str, start: str) -> list[str]:
    """The documented command of `page` that begins with `start`, as tokens after `torchrevive-run`."""
    lines = [c for p, c in documented_commands() if p == page and c.startswith(start)]
    assert lines, f"{page} no longer shows a command beginning {start!r}"
    return lines[0].split()[1:]


def points(directory: Path) -> Path:
    """The small data set (fixed: the reference run's cache key names it), in the session's shared directory."""
    path = directory / f"tutorial-points{POINTS}.npz"
    if not path.exists():
        generator = np.random.default_rng(0)
        tmp = directory / f".points.{os.getpid()}.npz"
        np.savez(tmp, x=generator.normal(size=(POINTS, 32)).astype(np.float32), y=generator.integers(0, 8, size=POINTS))
        tmp.replace(path)
    return path


def launcher(tokens: list[str]) -> list[str]:
    return [sys.executable, "-m", "elastic._agent.launcher", *tokens]


def test_the_readmes_standalone_line_survives_a_kill_at_an_epochs_end_bit_identical(
    tmp_path: Path, references: References
) -> None:
    tokens = the_line("README.md", "torchrevive-run --standalone --nproc-per-node=2 recipes/tutorial.py --ckpt-dir")
    data, ckpt, events, go = points(references.directory), tmp_path / "ckpt", tmp_path / "events.jsonl", tmp_path / "go"
    tokens = [str(ckpt) if token == "ckpt" else str(REPO / token) if token.endswith(".py") else token for token in tokens]
    epoch_end = -(-(POINTS - POINTS // 8) // (2 * BATCH))  # the last step of epoch 0
    # Rank 1 holds after that step (its checkpoint, --ckpt-every 1e, on its way), rank 0 goes on into the
    # epoch's evaluation; once the checkpoint is committed, rank 1 is SIGKILLed.
    env = worker_env(ELASTIC_FAULT=f"after_step@{epoch_end}:rank=1:do=hold:until={go}")
    agents = start_agents(1, launcher([*tokens, "--data", str(data), "--events", str(events), *SIZE]), tmp_path, env=env)
    try:
        wait_for(lambda: Path(f"{go}.held").exists(), 180, f"rank 1 to hold after step {epoch_end}")
        wait_for(lambda: any(c.step == epoch_end for c in CheckpointStore(ckpt).committed()), 60, "the epoch's checkpoint")
        victim = next(pid for pid in descendants(agents[0].pid) if worker_rank(pid) == 1)
        os.kill(victim, signal.SIGKILL)
    except BaseException:
        stop_all(agents)
        raise
    assert wait_all(agents, timeout=300) == [0], logs(tmp_path)
    records = list(read_events(events))
    assert [e["step"] for e in records if e["event"] == "restore"] == [epoch_end], "resumed past the epoch's end"
    clean = references.final_checkpoint(["--data", str(data), *SIZE], STEPS, script=TUTORIAL)
    assert_same_tensors(checkpoint_tensors(clean.parent, STEPS), checkpoint_tensors(ckpt, STEPS),
                        "after a kill at an epoch's end, its evaluation skipped by the resumed run")
    failures = [e for e in records if e["event"] == "failure"]
    assert [(e["rank"], e["exitcode"]) for e in failures if e["primary"]] == [(1, -signal.SIGKILL)], failures
    survivor = (tmp_path / "agent0.log").read_text(errors="replace")
    assert "received SIGTERM" not in survivor, "a survivor stopped for a peer's death is no preemption"
    assert 'recipes/tutorial.py", line' not in survivor, "a survivor stopped for a peer's death prints no traceback"


def test_a_range_of_nodes_with_no_backend_and_no_max_restarts_recovers(tmp_path: Path, references: References) -> None:
    """huggingface.md's line: it hung under torchrun's static backend, and torchrun's 0 restarts ended it."""
    tokens = the_line("huggingface.md", "torchrevive-run --nnodes=1:4")
    assert not any(t.startswith(("--rdzv-backend", "--max-restarts")) for t in tokens), tokens
    filled = {"--nproc-per-node=8": "--nproc-per-node=1", "--rdzv-endpoint=HOST:29400": f"--rdzv-endpoint=127.0.0.1:{free_port()}",
              "--rdzv-id=job1": f"--rdzv-id={tmp_path.name}", "train.py": str(TUTORIAL)}
    tokens = [filled.get(token, token) for token in tokens]
    assert set(filled.values()) <= set(tokens), tokens
    events = tmp_path / "events.jsonl"
    args = ["--data", str(points(references.directory)), "--epochs", "2", "--batch-size", str(BATCH), "--workers", "0",
            "--ckpt-dir", str(tmp_path / "ckpt"), "--events", str(events)]
    agents = start_agents(1, launcher([*tokens, *args]), tmp_path)
    try:
        wait_for(lambda: steps_seen(events) >= 5, 180, "step 5")
        os.kill(next(pid for pid in descendants(agents[0].pid) if worker_rank(pid) == 0), signal.SIGKILL)
    except BaseException:
        stop_all(agents)
        raise
    assert wait_all(agents, timeout=300) == [0], logs(tmp_path)
    records = list(read_events(events))
    assert len([e for e in records if e["event"] == "start"]) == 2, "the agent restarted its worker"
    assert [e["step"] for e in records if e["event"] == "end"] == [-(-2 * (POINTS - POINTS // 8) // BATCH)]
