"""Uninterrupted reference runs, each run once per test session and shared by every file and every
pytest-xdist worker that compares a job against one.

A test that proves a fault changed nothing compares its job's final checkpoint with that of a
job that never saw the fault. Those reference jobs are the same from one test to the next (the
recipe, its arguments, two ranks), so they are cached: the first worker to need one runs it under
a file lock in the directory the session's workers share, and the others read its checkpoint.
The cache key is the script and its arguments; the final weights do not depend on the launcher,
on how the two ranks are spread over agents, or on how often the job checkpoints.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import warm
from support import GPT_RECIPE, make_text

from elastic._worker.checkpoint import read_checkpoint
from elastic.chaos.harness import ChaosJob
from elastic.chaos.job_spec import JobSpec
from elastic.chaos.verdict import verified_final_checkpoint

REFERENCE_STEPS = 60
"""The steps of the shared GPT jobs: room for a chain of three faults, each after the last recovery."""
TINY_GPT = ("--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--batch-size", "8")
"""The chaos harness's model (elastic.chaos.scenarios.run_scenario's default): milliseconds a step."""


def session_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A temporary directory of this test session that every pytest-xdist worker shares (each
    worker's own base directory sits in it; without xdist, the base directory itself)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_corpus(directory: Path) -> Path:
    """The same 40 KB of text for every test and worker that shares reference runs."""
    path = directory / "shared-corpus.txt"
    text = make_text(random.Random(7), 40_000)
    if not path.exists() or path.read_text() != text:
        tmp = path.with_suffix(f".{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(path)
    return path


def gpt_args(corpus: Path, steps: int = REFERENCE_STEPS, *extra: str) -> list[str]:
    """The GPT recipe's arguments of the shared jobs (no --ckpt-dir, --ckpt-every or --events: each job its own)."""
    return ["--data", str(corpus), "--max-steps", str(steps), "--eval-every", "0", "--dropout", "0.1", *TINY_GPT, *extra]


class References:
    """`tensors(args, steps)`: every tensor (model and optimizer, by checkpoint key) of the final
    checkpoint of an uninterrupted two-rank run of `script` with `args`, which end at `steps`.
    `{workdir}` in an argument stands for the reference run's own directory (for outputs)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def tensors(self, args: Sequence[str], steps: int, script: Path = GPT_RECIPE) -> dict[str, torch.Tensor]:
        return read_checkpoint(self.final_checkpoint(args, steps, script))[1]

    def final_checkpoint(self, args: Sequence[str], steps: int, script: Path = GPT_RECIPE) -> Path:
        """The final checkpoint's directory (verified) of the reference run of `script` with `args`."""
        from filelock import FileLock

        key = hashlib.sha256("\0".join([str(script), *args]).encode()).hexdigest()[:16]
        workdir = self.directory / f"reference-{Path(script).stem}-{steps}-{key}"
        with FileLock(f"{workdir}.lock"):
            name, error = verified_final_checkpoint(workdir / "ckpt", steps) if workdir.exists() else (None, None)
            if name is None:
                shutil.rmtree(workdir, ignore_errors=True)
                workdir.mkdir()
                own = [arg.replace("{workdir}", str(workdir)) for arg in args]
                spec = JobSpec(workdir=workdir, nnodes="2:2", run_id="reference", script=script,
                               script_args=[*own, "--ckpt-dir", str(workdir / "ckpt"), "--ckpt-every", "0"],
                               start_process=warm.popen)
                with ChaosJob(spec) as job:
                    job.start()
                    assert job.wait(240) == [0, 0], job.logs()
                    assert not [r for r in job.records() if r["event"] == "restore"], "the reference run restored"
                name, error = verified_final_checkpoint(workdir / "ckpt", steps)
            assert name, error
            return workdir / "ckpt" / name
