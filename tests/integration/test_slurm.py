"""The Slurm launch shapes, preemption and requeue, and a lost node, on a real one-machine Slurm
(tests/slurm_cluster.py: munged, slurmctld, slurmd for nodes n1 and n2).

Every job trains the GPT recipe's tiny model on a world of two for `STEPS` steps from the same
seed, so every job's final checkpoint must equal the uninterrupted `srun python` run's, tensor for
tensor, whatever launched it and however often it was preempted."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from slurm_cluster import SlurmCluster, SlurmUnavailable
from support import REPO, make_text, steps_seen, wait_for

from elastic.chaos.verdict import verified_final_checkpoint
from elastic.checkpoint import read_checkpoint
from elastic.events import read_events
from elastic.slurm.hostlist import expand_hostlist

pytestmark = pytest.mark.slow

STEPS = 30
MODEL = ("--batch-size", "2", "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
         "--eval-every", "0", "--ckpt-every", "10", "--dropout", "0.1", "--seed", "3", "--device", "cpu",
         "--sample-tokens", "0")
PACED = {"ELASTIC_FAULT": "after_step@1+:do=slow:for=0.3:restart=any"}  # rank 0's steps take >= 0.3 s
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        pytest.skip(str(exc))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("slurm-data") / "corpus.txt"
    path.write_text(make_text(random.Random(11), 30_000))
    return path


@pytest.fixture(scope="module")
def reference(slurm: SlurmCluster, corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The uninterrupted run: `srun python recipes/gpt.py`, one task per worker on n1 and n2."""
    ckpt = tmp_path_factory.mktemp("slurm-reference") / "ckpt"
    done = subprocess.run(
        ["srun", "-N2", "-n2", sys.executable, "recipes/gpt.py", *recipe_args(corpus, ckpt)],
        cwd=REPO, env=slurm.env(), capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    starts = [e for e in read_events(ckpt / "events.jsonl") if e["event"] == "start"]
    assert [(e["world_size"], e["run_id"].startswith("slurm-")) for e in starts] == [(2, True)], starts
    return final_tensors(ckpt)


def data_args(corpus: Path, steps: int = STEPS) -> list[str]:
    """The recipe's flags but where it saves (the batch scripts say that themselves)."""
    return ["--data", str(corpus), "--max-steps", str(steps), *MODEL]


def recipe_args(corpus: Path, ckpt: Path, steps: int = STEPS) -> list[str]:
    return [*data_args(corpus, steps), "--ckpt-dir", str(ckpt), "--events", str(ckpt / "events.jsonl")]


def final_tensors(ckpt: Path, steps: int = STEPS) -> dict[str, torch.Tensor]:
    name, error = verified_final_checkpoint(ckpt, steps)
    assert name, error
    return read_checkpoint(ckpt / name)[1]


def assert_same(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert want.keys() == got.keys() and any(k.startswith("optim/") for k in want)
    different = [k for k in sorted(want) if not torch.equal(want[k], got[k])]
    assert not different, f"{len(different)} tensors differ from the uninterrupted run, e.g. {different[:3]}"


def job_info(slurm: SlurmCluster, job: str) -> dict[str, str]:
    record = slurm.run(["scontrol", "show", "job", "-o", job])
    return dict(re.findall(r"(\w+)=(\S*)", record))


def sbatch(slurm: SlurmCluster, script: str, *args: str, sbatch_args: tuple[str, ...] = (), **env: str) -> str:
    """Submit one of deploy/slurm's scripts from the repository, with this interpreter's venv."""
    venv = str(Path(sys.executable).parent.parent)
    done = subprocess.run(["sbatch", "--parsable", *sbatch_args, f"deploy/slurm/{script}", *args], cwd=REPO,
                          env=slurm.env(TORCHREVIVE_VENV=venv, **env), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def wait_job(slurm: SlurmCluster, job: str, timeout: float) -> dict[str, str]:
    """Wait for the job to end; a requeued job pending on its begin time is let go at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(slurm, job)
        if info["JobState"] in DONE_STATES:
            return info
        if info["JobState"] == "PENDING" and info.get("Reason") == "BeginTime":
            # Slurm holds a requeued job ~2 min; let it go, but not within the second its last run's
            # credential was revoked (slurmd would refuse the new run's as revoked too).
            time.sleep(2)
            slurm.run(["scontrol", "update", f"jobid={job}", "starttime=now"])
        time.sleep(0.5)
    raise AssertionError(f"job {job} did not end in {timeout:g} s: {job_info(slurm, job)}\n{slurm.log_tail()}")


def test_our_host_lists_expand_as_scontrol_does(slurm: SlurmCluster) -> None:
    for text in ("n[1-2]", "node[01-04,07]", "gpu-a[8-11],login1", "r[1-2]n[09-10]", "n[1,3-4]", "x007"):
        want = slurm.run(["scontrol", "show", "hostnames", text]).split()
        assert expand_hostlist(text) == want, text


def test_srun_one_task_per_worker_trains_with_slurms_ranks(reference: dict[str, torch.Tensor]) -> None:
    assert reference  # the fixture ran the job and checked its world and run id


def test_srun_torchrevive_run_meets_at_the_first_node_and_ends_as_the_task_shape(
    slurm: SlurmCluster, corpus: Path, reference: dict[str, torch.Tensor], tmp_path: Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    done = subprocess.run(
        ["srun", "-N2", "--ntasks-per-node=1", sys.executable, "-m", "elastic.launcher", "--rdzv-endpoint=slurm",
         "--nproc-per-node=1", "recipes/gpt.py", *recipe_args(corpus, ckpt)],
        cwd=REPO, env=slurm.env(), capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    starts = [e for e in read_events(ckpt / "events.jsonl") if e["event"] == "start"]
    assert [(e["world_size"], e["run_id"]) for e in starts] == [(2, starts[0]["run_id"])], starts
    assert starts[0]["run_id"].startswith("slurm-")
    assert_same(reference, final_tensors(ckpt))


@pytest.mark.parametrize(("script", "how"), [("gpt-tasks.sbatch", "--batch"), ("gpt.sbatch", "--full")])
def test_the_requeue_signal_commits_requeues_once_and_resumes_bit_exact(
    slurm: SlurmCluster, corpus: Path, reference: dict[str, torch.Tensor], tmp_path: Path, script: str, how: str,
) -> None:
    """USR1 to the batch shell (which passes it on) or to every process of the job: every rank commits
    the step, one process requeues the job, and the requeued run resumes at that step."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    job = sbatch(slurm, script, *data_args(corpus),
                 sbatch_args=("-N2", "--ntasks-per-node=1", "--cpus-per-task=1", f"--output={log}"),
                 CKPT_DIR=str(ckpt), **PACED)
    events = ckpt / "events.jsonl"
    wait_for(lambda: steps_seen(events) >= 6, 120, f"job {job} training ({log})")
    slurm.run(["scancel", "--signal=USR1", how, job])
    info = wait_job(slurm, job, 240)
    output = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, output[-3000:])
    # One process requeued: worker rank 0 without an agent, the first node's agent with them.
    said = r"^(?:\S+ WARNING elastic\.slurm\.requeue: stopped|torchrevive-run: Slurm job).*requeued \(scontrol"
    requeues = re.findall(said, output, re.M)
    assert len(requeues) == 1, output[-3000:]
    seen = list(read_events(events))
    starts = [e for e in seen if e["event"] == "start"]
    assert len(starts) == 2, starts  # the first run and the requeued one
    committed = [e["step"] for e in seen if e["event"] == "checkpoint" and e["time"] < starts[1]["time"]]
    assert committed and starts[1]["step"] == max(committed) >= 6, (seen, committed)  # resumed at the preempted step
    assert_same(reference, final_tensors(ckpt))


def test_scancel_under_agents_commits_the_step_once_and_does_not_requeue(
    slurm: SlurmCluster, corpus: Path, tmp_path: Path,
) -> None:
    """`scancel` (SIGTERM to every process of the step, and the agents pass their own on): the workers
    take the two as one, commit the step and leave; nobody requeues."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    job = sbatch(slurm, "gpt.sbatch", *data_args(corpus, 200),
                 sbatch_args=("-N2", "--ntasks-per-node=1", "--cpus-per-task=1", f"--output={log}"),
                 CKPT_DIR=str(ckpt), **PACED)
    events = ckpt / "events.jsonl"
    wait_for(lambda: steps_seen(events) >= 6, 120, f"job {job} training ({log})")
    slurm.run(["scancel", job])
    info = wait_job(slurm, job, 120)
    output = log.read_text()
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", (info, output[-3000:])
    stopped = [e["step"] for e in read_events(events) if e["event"] == "checkpoint" and e["step"] >= 6]
    assert stopped, f"no checkpoint of the stopped step: {output[-3000:]}"
    assert verified_final_checkpoint(ckpt, max(stopped))[0], output[-3000:]
    assert "requeued" not in output, output[-3000:]


def test_a_job_without_requeue_commits_on_the_signal_and_says_it_is_not_requeued(
    slurm: SlurmCluster, corpus: Path, tmp_path: Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(
        ["srun", "-N2", "-n2", "--job-name=no-requeue", sys.executable, "recipes/gpt.py",
         *recipe_args(corpus, ckpt, steps=200)],
        cwd=REPO, env=slurm.env(**PACED), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_for(lambda: steps_seen(ckpt / "events.jsonl") >= 4, 120, "the srun job training")
        job = slurm.run(["squeue", "-h", "-n", "no-requeue", "-o", "%i"]).strip()
        slurm.run(["scancel", "--signal=USR1", job])
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode != 0, err[-3000:]
    assert "not requeued: it was submitted without --requeue" in err, err[-3000:]
    stopped = re.search(r"stopped by the Slurm requeue signal after step (\d+); checkpoint committed", err)
    assert stopped, err[-3000:]
    assert verified_final_checkpoint(ckpt, int(stopped.group(1)))[0], "the preempted step is not committed"
    assert job_info(slurm, job)["Restarts"] == "0"


def test_bad_input_fails_the_job_once_and_is_never_requeued(slurm: SlurmCluster, tmp_path: Path) -> None:
    log = tmp_path / "job.out"
    job = sbatch(slurm, "gpt-tasks.sbatch", "--max-steps", "-3",
                 sbatch_args=("-N1", "--ntasks-per-node=1", f"--output={log}"), CKPT_DIR=str(tmp_path / "ckpt"))
    info = wait_job(slurm, job, 120)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "2:0", "0"), (info, log.read_text())
    assert "error: argument --max-steps" in log.read_text()


def processes_of(job: str, node: str) -> list[int]:
    """The Python processes of `job` on `node` (from /proc): an agent, its fork server and workers."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")[0]
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (b"python" in command and f"SLURM_JOB_ID={job}".encode() in environ
                and f"SLURMD_NODENAME={node}".encode() in environ):
            found.append(int(entry.name))
    return found


def test_a_lost_node_shrinks_the_job_and_a_replacement_allocation_joins_it(
    slurm: SlurmCluster, corpus: Path, tmp_path: Path,
) -> None:
    """SIGKILL to every process of the job on node n2 (a node loss, as n1 sees it): under
    `srun --kill-on-bad-exit=0` the step goes on and n1's agent trains on at world size 1. Then an
    agent of another allocation on n2 joins with `--rdzv-endpoint=slurm:JOBID`: world size 2 again,
    to the end."""
    steps = 150  # paced: time for the replacement to start and join while the job runs on alone
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    job = sbatch(slurm, "gpt.sbatch", *data_args(corpus, steps),
                 sbatch_args=("-N2", "--ntasks-per-node=1", "--cpus-per-task=1", f"--output={log}"),
                 CKPT_DIR=str(ckpt), **PACED)
    events = ckpt / "events.jsonl"
    wait_for(lambda: steps_seen(events) >= 6, 120, f"job {job} training ({log})")
    for pid in wait_for(lambda: processes_of(job, "n2"), 10, "n2's processes"):  # all at once, as a node dies
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def worlds() -> list[int]:
        return [e["world_size"] for e in read_events(events) if e["event"] == "start"]

    wait_for(lambda: worlds()[-1] == 1, 120, f"job {job} going on alone ({log})")
    replacement = subprocess.Popen(
        ["srun", "-w", "n2", "-N1", "-n1", "-c1", sys.executable, "-m", "elastic.launcher",
         f"--rdzv-endpoint=slurm:{job}", "--nproc-per-node=1", "recipes/gpt.py", *data_args(corpus, steps),
         "--ckpt-dir", str(ckpt), "--events", str(events)],
        cwd=REPO, env=slurm.env(**PACED), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        joined, _ = replacement.communicate(timeout=240)
    finally:
        replacement.kill()
    wait_job(slurm, job, 120)
    output = log.read_text()
    seen = list(read_events(events))
    sizes = [e["world_size"] for e in seen if e["event"] == "start"]
    ends = [e for e in seen if e["event"] == "end"]
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2, (sizes, output[-2000:], joined[-2000:])
    assert replacement.returncode == 0, joined[-3000:]
    assert ends and ends[-1]["step"] == steps and ends[-1]["world_size"] == 2, output[-3000:]
