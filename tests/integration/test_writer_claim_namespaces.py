"""A job killed in one pid namespace and restarted in another (a container restart) resumes,
though its old pid now belongs to a live, unrelated process. The writer claim names processes by
boot id, namespace, pid and start time, never by a bare pid."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import GPT_RECIPE, REPO, TINY_MODEL, wait_for, worker_env

from elastic._shared.storage.claim import WRITER
from elastic._shared.storage.directory import CheckpointStore

pytestmark = pytest.mark.skipif(
    shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare (util-linux) and root for pid namespaces"
)


def recipe(corpus: Path, ckpt: Path, steps: int) -> list[str]:
    return [sys.executable, str(GPT_RECIPE), "--data", str(corpus), "--max-steps", str(steps), "--eval-every", "0",
            "--ckpt-dir", str(ckpt), "--ckpt-every", "2", *TINY_MODEL]


def in_namespace(script: str, *args: str, **kwargs) -> subprocess.Popen:
    """`sh -c script args` as the first process of a fresh pid namespace with its own /proc."""
    return subprocess.Popen(
        ["unshare", "--fork", "--pid", "--mount-proc", "sh", "-c", script, "sh", *args],
        cwd=REPO, env=worker_env(), text=True, stderr=subprocess.PIPE, **kwargs,
    )


def killed_after_a_checkpoint(process: subprocess.Popen, ckpt: Path) -> int:
    """Kill the namespace's processes once a checkpoint is committed; the step it holds."""
    store = CheckpointStore(ckpt)
    step = wait_for(lambda: store.committed()[0].step if ckpt.is_dir() and store.committed() else 0, 300, "a checkpoint")
    inside = _child_of(process.pid)  # the job (unshare and nsenter fork it into the namespace)
    if inside is not None:
        os.kill(inside, signal.SIGKILL)
    process.kill()
    process.wait()
    return step


def test_a_job_restarted_in_a_fresh_pid_namespace_resumes(tmp_path: Path, tiny_corpus: Path) -> None:
    ckpt = tmp_path / "ckpt"
    # First life: the recipe is pid 1 of its namespace (sh execs it).
    first = subprocess.Popen(
        ["unshare", "--fork", "--pid", "--mount-proc", "--kill-child", *recipe(tiny_corpus, ckpt, 10_000)],
        cwd=REPO, env=worker_env(), text=True, stderr=subprocess.DEVNULL,
    )
    resumed_from = killed_after_a_checkpoint(first, ckpt)
    claim = json.loads((ckpt / WRITER).read_text())
    assert claim["pid"] == 1 and claim["run_id"] == "local"
    # Second life: pid 1 is a shell that lives on (unrelated to the claim), the recipe a child of it.
    second = in_namespace('"$@"; status=$?; exit $status', *recipe(tiny_corpus, ckpt, resumed_from + 2))
    _, stderr = second.communicate(timeout=300)
    assert second.returncode == 0, stderr[-3000:]
    assert "written by another job" not in stderr
    assert f"resumed from step_{resumed_from:08d}" in stderr
    assert CheckpointStore(ckpt).committed()[0].step == resumed_from + 2
    assert json.loads((ckpt / WRITER).read_text())["pid"] != 1


def _child_of(pid: int) -> int | None:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None
