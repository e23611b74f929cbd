"""Pid namespaces: a job killed in one and restarted in another (a container restart) resumes,
though its old pid now belongs to a live, unrelated process; and two jobs side by side (docker
--ipc=host --network=host: one /dev/shm, one host name, each its own pid namespace, both pid 1)
harm neither the other's keeper directory nor its writer claim. The writer claim and a keeper's
owner.json name processes by boot id, namespace, pid, start time and a liveness token, never by a
bare pid."""

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

from elastic._shared.storage import liveness
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


SIDE_BY_SIDE = """
import itertools, json, os, sys
from pathlib import Path
from elastic._agent.launcher.keeper import SnapshotKeeper
from elastic._agent.launcher.keeper_files import private_directory, remove_orphans
from elastic._shared.common.errors import CheckpointStorageError
from elastic._shared.storage import claim
from elastic._shared.storage.peer_auth import PeerKey
base, ckpt, run = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
keeper = SnapshotKeeper("127.0.0.1", key=PeerKey(b"k" * 32), run_id=run, base=base)  # removes orphans first
me = claim.WriterIdentity.new(run)
for _ in itertools.chain([None], sys.stdin):  # at start, then once per line: orphans removed again, the claim tried again
    remove_orphans(private_directory(base))
    try:
        claim.claim(ckpt, me)
        said = "claimed"
    except CheckpointStorageError as exc:
        said = "refused: " + str(exc)
    print(json.dumps({"pid": os.getpid(), "dir": keeper.node, "claim": said}), flush=True)
"""


def test_two_jobs_side_by_side_in_pid_namespaces_harm_neither_the_other(tmp_path: Path) -> None:
    """Both are pid 1 of their namespace, on one snapshot base and host name, claiming one
    --ckpt-dir (a misconfiguration the claim exists for): the second neither removes the first's
    keeper directory nor takes its claim while it lives; once it is gone (SIGKILL: no cleanup ran),
    both happen."""
    base, ckpt = tmp_path / "shm", tmp_path / "ckpt"
    ckpt.mkdir()

    def job(run: str) -> tuple[subprocess.Popen, dict]:
        process = subprocess.Popen(
            ["unshare", "--fork", "--pid", "--mount-proc", "--kill-child", sys.executable, "-c", SIDE_BY_SIDE,
             str(base), str(ckpt), run],
            cwd=REPO, env=worker_env(), text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        return process, said(process)

    def said(process: subprocess.Popen) -> dict:
        line = process.stdout.readline()
        assert line, process.stderr.read()[-3000:] if process.poll() is not None else "no answer"
        return json.loads(line)

    first, a = job("job-a")
    second = None
    try:
        second, b = job("job-b")
        keepers = base / f"torchrevive-snapshots-{os.geteuid()}"
        assert a["pid"] == b["pid"] == 1, (a, b)  # one pid, two processes: a pid alone tells nothing
        assert a["claim"] == "claimed" and b["claim"].startswith("refused: "), (a, b)
        assert "written by another job (run job-a" in b["claim"]
        assert (keepers / a["dir"]).is_dir() and (keepers / b["dir"]).is_dir()
        assert json.loads((ckpt / WRITER).read_text())["run_id"] == "job-a"
        # The first job dies without a word: its directory and its claim are left behind.
        token = json.loads((keepers / a["dir"] / "owner.json").read_text())["token"]
        first.kill()
        first.wait(timeout=60)
        wait_for(lambda: liveness.token_alive(token) is False, 60, "the first job's liveness token to be freed")
        second.stdin.write("again\n")
        second.stdin.flush()
        b = said(second)
        assert b["claim"] == "claimed", b
        assert not (keepers / a["dir"]).exists() and (keepers / b["dir"]).is_dir()
        assert json.loads((ckpt / WRITER).read_text())["run_id"] == "job-b"
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(timeout=60)


def _child_of(pid: int) -> int | None:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None
