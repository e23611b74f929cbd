"""The Slurm launch shapes, preemption and requeue, and a lost node, on a real one-machine Slurm
(tests/slurm_cluster.py: munged, slurmctld, slurmd for nodes n1 and n2).

Every job trains the GPT recipe's tiny model on a world of two for `STEPS` steps from the same
seed, so every job's final checkpoint must equal an uninterrupted run's, tensor for tensor, whatever
launched it and however often it was preempted. That reference run is made once per test session
(every pytest-xdist worker reads it).

A job is paced (`PACE`, elastic.chaos.faults) only while the test must act on it: until it took
the signal, or until a node joined it; it trains at full speed after that."""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import warm
from references import session_directory
from slurm_cluster import SlurmCluster, SlurmUnavailable
from support import REPO, free_port, logs, make_text, steps_seen, wait_for, worker_env

from elastic._shared.slurm.hostlist import expand_hostlist
from elastic._worker.checkpoint import read_checkpoint
from elastic._worker.observe.events import read_events
from elastic.chaos.verdict import verified_final_checkpoint

pytestmark = pytest.mark.slow

STEPS = 30
MODEL = ("--batch-size", "2", "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
         "--eval-every", "0", "--ckpt-every", "10", "--dropout", "0.1", "--seed", "3", "--device", "cpu",
         "--sample-tokens", "0")
PACE = "after_step@1+:do=slow:for=0.3"
"""Rank 0's steps take >= 0.3 s, on restart 0 only: in a job of tasks that is its first run (SLURM_RESTART_COUNT),
so its requeued run trains at full speed."""
SIGNAL_AT = 6
"""The step after which a test signals a paced job."""
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}
BOTH_NODES = {"MIN_NODES": "2"}
"""gpt.sbatch's agents train only on both nodes (`--nnodes 2:2`). With its default, 1:2, the first agent up
trains alone when the other comes more than the rendezvous' last call (2 s) later, as on a busy machine,
and the other joins it a few steps on: a world of one first, and other tensors."""
REQUEUED_LINE = r"^(?:\S+ WARNING elastic\._shared\.slurm\.requeue: stopped|torchrevive-run: Slurm job).*requeued \(scontrol"
"""The line of the one process that requeues: worker rank 0 without an agent, the first node's agent with them."""


def paced_until(step: int) -> str:
    """`PACE` for steps 1..`step` only: under agents a requeued run's workers are restart 0 as well (fresh
    agents), so there the pace ends at a step instead, well past the one the test signals after (the
    workers commit some 4 steps after the signal)."""
    return ",".join(f"after_step@{each}:do=slow:for=0.3:restart=any" for each in range(1, step + 1))


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        pytest.skip(str(exc))
    yield cluster
    # A test that failed may have left its job running: cancel it while the daemons can (slurmstepd and the
    # job's processes outlive them), and give it KillWait and a margin to go.
    left = cluster.run(["squeue", "-h", "-o", "%i"], check=False).split()
    if left:
        cluster.run(["scancel", *left], check=False)
        deadline = time.monotonic() + 30
        while cluster.run(["squeue", "-h", "-o", "%i"], check=False).split() and time.monotonic() < deadline:
            time.sleep(0.2)
    cluster.stop()


@pytest.fixture(autouse=True)
def idle(slurm: SlurmCluster) -> None:
    """Each test starts on an idle cluster (SlurmCluster.wait_idle): a srun once waited 120 s behind
    what an earlier test left, and the test failed without saying why."""
    slurm.wait_idle()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The jobs' text, one file for the session (the cached reference run names its path)."""
    path = session_directory(tmp_path_factory) / "slurm-corpus.txt"
    text = make_text(random.Random(11), 30_000)
    if not path.exists() or path.read_text() != text:
        tmp = path.with_suffix(f".{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(path)
    return path


@pytest.fixture(scope="module")
def reference(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The final tensors of the uninterrupted run: the recipe's two ranks, forked warm (tests/warm.py) with
    torchrun's variables; the final weights do not depend on the launcher (tests/references.py). Made once per
    session: the first xdist worker to need it runs it under a lock in the directory the workers share, the
    others read it."""
    from filelock import FileLock

    workdir = session_directory(tmp_path_factory) / "slurm-reference"
    ckpt = workdir / "ckpt"
    with FileLock(f"{workdir}.lock"):
        if not (ckpt.exists() and verified_final_checkpoint(ckpt, STEPS)[0]):
            shutil.rmtree(workdir, ignore_errors=True)
            workdir.mkdir()
            port, procs = free_port(), []
            try:
                for rank in range(2):
                    env = worker_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                    with (workdir / f"rank{rank}.log").open("w") as log:
                        procs.append(warm.start([sys.executable, "recipes/gpt.py", *recipe_args(corpus, ckpt)],
                                                env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
                codes = [proc.wait(180) for proc in procs]
            finally:
                for proc in procs:
                    proc.kill()
            assert codes == [0, 0], logs(workdir)
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


def starts_of(events: Path) -> list[tuple[int, str]]:
    """(world size, run id) of each start in an event log."""
    return [(e["world_size"], e["run_id"]) for e in read_events(events) if e["event"] == "start"]


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
            # credential was revoked (slurmd would refuse the new run's as revoked too: it compares whole
            # seconds). That was before now, so from the next whole second on.
            seen = time.time()
            time.sleep(math.floor(seen) + 1.2 - seen)
            slurm.run(["scontrol", "update", f"jobid={job}", "starttime=now"])
        time.sleep(0.2)
    raise AssertionError(f"job {job} did not end in {timeout:g} s: {job_info(slurm, job)}\n{slurm.log_tail()}")


def test_our_host_lists_expand_as_scontrol_does(slurm: SlurmCluster) -> None:
    for text in ("n[1-2]", "node[01-04,07]", "gpu-a[8-11],login1", "r[1-2]n[09-10]", "n[1,3-4]", "x007"):
        want = slurm.run(["scontrol", "show", "hostnames", text]).split()
        assert expand_hostlist(text) == want, text


def requeue_once_and_resume(
    slurm: SlurmCluster, corpus: Path, reference: dict[str, torch.Tensor], tmp_path: Path, script: str, how: str,
    fault: str, **env: str,
) -> tuple[str, list[tuple[int, str]]]:
    """Submit `script` paced by `fault` (with `env`), send USR1 `how` once it trained `SIGNAL_AT` steps: every
    rank commits the step, one process requeues the job, and the requeued run resumes at that step and ends
    bit-exact. Returns the job id and its starts (world size, run id)."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    job = sbatch(slurm, script, *data_args(corpus),
                 sbatch_args=("-N2", "--ntasks-per-node=1", "--cpus-per-task=1", f"--output={log}"),
                 CKPT_DIR=str(ckpt), ELASTIC_FAULT=fault, **env)
    events = ckpt / "events.jsonl"
    wait_for(lambda: steps_seen(events) >= SIGNAL_AT, 120, f"job {job} training ({log})")
    slurm.run(["scancel", "--signal=USR1", how, job])
    info = wait_job(slurm, job, 240)
    output = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, output[-3000:])
    assert len(re.findall(REQUEUED_LINE, output, re.M)) == 1, output[-3000:]
    seen = list(read_events(events))
    starts = [e for e in seen if e["event"] == "start"]
    assert len(starts) == 2, starts  # the first run and the requeued one
    committed = [e["step"] for e in seen if e["event"] == "checkpoint" and e["time"] < starts[1]["time"]]
    # resumed at the preempted step
    assert committed and starts[1]["step"] == max(committed) >= SIGNAL_AT, (seen, committed)
    assert_same(reference, final_tensors(ckpt))
    return job, [(e["world_size"], e["run_id"]) for e in starts]


def test_the_requeue_signal_to_the_batch_shell_requeues_a_job_of_tasks_once_and_bad_input_never(
    slurm: SlurmCluster, corpus: Path, reference: dict[str, torch.Tensor], tmp_path: Path,
) -> None:
    """gpt-tasks.sbatch (`srun python`, one task per worker: each trains with Slurm's ranks, a world of two,
    as run `slurm-JOBID`): USR1 to the batch shell, which passes it on; worker rank 0 requeues, and the
    requeued run trains to the end. Beside it, the same script given bad input fails once (exit 2) and is
    never requeued."""
    bad_log = tmp_path / "bad.out"
    bad = sbatch(slurm, "gpt-tasks.sbatch", "--max-steps", "-3",
                 sbatch_args=("-N1", "--ntasks-per-node=1", f"--output={bad_log}"), CKPT_DIR=str(tmp_path / "bad"))
    job, starts = requeue_once_and_resume(slurm, corpus, reference, tmp_path, "gpt-tasks.sbatch", "--batch", PACE)
    assert starts == [(2, f"slurm-{job}")] * 2
    info = wait_job(slurm, bad, 120)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "2:0", "0"), (info, bad_log.read_text())
    assert "error: argument --max-steps" in bad_log.read_text()


def test_the_requeue_signal_under_agents_meets_at_the_first_node_requeues_once_and_resumes_bit_exact(
    slurm: SlurmCluster, corpus: Path, reference: dict[str, torch.Tensor], tmp_path: Path,
) -> None:
    """gpt.sbatch (`srun torchrevive-run --rdzv-endpoint=slurm`, an agent per node): both runs meet at the
    first node as one world of two, the run `slurm-JOBID`, and the job ends with the uninterrupted run's
    tensors, as the task shape's does. USR1 to every process of the job: the agents stop their workers,
    which commit the step; the first node's agent requeues."""
    job, starts = requeue_once_and_resume(slurm, corpus, reference, tmp_path, "gpt.sbatch", "--full",
                                          paced_until(SIGNAL_AT + 18), **BOTH_NODES)
    assert starts == [(2, f"slurm-{job}")] * 2


def test_scancel_under_agents_commits_the_step_once_and_does_not_requeue(
    slurm: SlurmCluster, corpus: Path, tmp_path: Path,
) -> None:
    """`scancel` (SIGTERM to every process of the step, and the agents pass their own on): the workers
    take the two as one, commit the step and leave; nobody requeues."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    job = sbatch(slurm, "gpt.sbatch", *data_args(corpus, 200),
                 sbatch_args=("-N2", "--ntasks-per-node=1", "--cpus-per-task=1", f"--output={log}"),
                 CKPT_DIR=str(ckpt), ELASTIC_FAULT=PACE, **BOTH_NODES)
    events = ckpt / "events.jsonl"
    wait_for(lambda: steps_seen(events) >= SIGNAL_AT, 120, f"job {job} training ({log})")
    slurm.run(["scancel", job])
    info = wait_job(slurm, job, 120)
    output = log.read_text()
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", (info, output[-3000:])
    stopped = [e["step"] for e in read_events(events) if e["event"] == "checkpoint" and e["step"] >= SIGNAL_AT]
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
        cwd=REPO, env=slurm.env(ELASTIC_FAULT=PACE), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        try:
            wait_for(lambda: steps_seen(ckpt / "events.jsonl") >= 4, 120, "the srun job training")
        except AssertionError as exc:
            proc.kill()
            raise AssertionError(f"{exc}\n{slurm.state()}\nsrun: {proc.communicate(timeout=30)[1][-3000:]}") from None
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
    # the task shape without sbatch: Slurm's ranks, one world of two, the run `slurm-JOBID`
    assert starts_of(ckpt / "events.jsonl") == [(2, f"slurm-{job}")]


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
    # Paced at world size 2 before the loss (restart 0) and at world size 1 after it (restart 1, up to
    # 0.3 s x `steps`: time for the replacement to start and join however slow this machine is); at full
    # speed once it joined (n1's worker is restart 1 at world size 2, the replacement has no fault).
    steps = 240
    pace = f"{PACE}:world=2,{PACE}:restart=any:world=1"
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    job = sbatch(slurm, "gpt.sbatch", *data_args(corpus, steps),
                 sbatch_args=("-N2", "--ntasks-per-node=1", "--cpus-per-task=1", f"--output={log}"),
                 CKPT_DIR=str(ckpt), ELASTIC_FAULT=pace)
    events = ckpt / "events.jsonl"

    def on_both_nodes() -> bool:  # the first agent up may train alone a few steps (`BOTH_NODES`)
        return steps_seen(events) >= SIGNAL_AT and starts_of(events)[-1][0] == 2

    wait_for(on_both_nodes, 120, f"job {job} training on both nodes ({log})")
    for pid in wait_for(lambda: processes_of(job, "n2"), 10, "n2's processes"):  # all at once, as a node dies
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    wait_for(lambda: starts_of(events)[-1][0] == 1, 120, f"job {job} going on alone ({log})")
    replacement = subprocess.Popen(
        ["srun", "-w", "n2", "-N1", "-n1", "-c1", sys.executable, "-m", "elastic._agent.launcher",
         f"--rdzv-endpoint=slurm:{job}", "--nproc-per-node=1", "recipes/gpt.py", *data_args(corpus, steps),
         "--ckpt-dir", str(ckpt), "--events", str(events)],
        # the job's secret (the batch script keeps it in the checkpoint directory): its rendezvous state is signed
        cwd=REPO, env=slurm.env(TORCHREVIVE_SNAPSHOT_SECRET_FILE=str(ckpt / ".snapshot-secret")),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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
    # world size 2, then 1 (n2 lost), then 2 again (the replacement), to the end
    phases = [size for i, size in enumerate(sizes) if i == 0 or size != sizes[i - 1]]
    assert phases[-3:] == [2, 1, 2], (sizes, output[-2000:], joined[-2000:])
    assert replacement.returncode == 0, joined[-3000:]
    assert ends and ends[-1]["step"] == steps and ends[-1]["world_size"] == 2, output[-3000:]
