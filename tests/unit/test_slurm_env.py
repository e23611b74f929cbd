"""Slurm's variables, in the formats Slurm writes them, read into a task's place in its step
(elastic._shared.slurm.step, elastic._shared.slurm.hostlist) and into an agent's rendezvous
(`--rdzv-endpoint=slurm`); bad values are one line naming the variable."""

from __future__ import annotations

import signal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic._agent.launcher.launch import parse_args
from elastic._agent.launcher.slurm_launch import expand_endpoint
from elastic._shared.common.errors import EnvironmentConfigError, UsageError
from elastic._shared.slurm.hostlist import (
    MAX_EXPANDED,
    expand_hostlist,
    expand_tasks_per_node,
)
from elastic._shared.slurm.requeue import requeue_signal
from elastic._shared.slurm.step import MASTER_PORT_BASE, in_step
from elastic._worker.runtime.worker_env import SINGLE_PROCESS, parse_launch_env

# Task 3 of `srun -N2 --ntasks-per-node=2` in job 2, as Slurm 22.05 set it (trimmed).
SRUN_TASK = {
    "SLURMD_NODENAME": "n2", "SLURM_JOB_ID": "2", "SLURM_JOBID": "2", "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_JOB_NUM_NODES": "2", "SLURM_LOCALID": "1", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
    "SLURM_NODELIST": "n[1-2]", "SLURM_NPROCS": "4", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_PROCID": "3", "SLURM_STEPID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "n[1-2]",
    "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_TASK_PID": "23278",
}
# The batch shell of the same job: Slurm's variables, but no step.
BATCH_SHELL = {k: v for k, v in SRUN_TASK.items() if not k.startswith(("SLURM_STEP", "SLURM_STEPID"))}


@pytest.mark.parametrize(("text", "hosts"), [
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("n[1-2]", ["n1", "n2"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("gpu-a[8-9],login1", ["gpu-a8", "gpu-a9", "login1"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("solo", ["solo"]),
    ("n[1-2]-ib", ["n1-ib", "n2-ib"]),  # a suffix: newer Slurm reads it, 22.05 refuses it
])
def test_host_lists_expand_as_scontrol_show_hostnames(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(("text", "why"), [
    ("n[1-2", "leaves a bracket open"), ("n1-2]", "closes a bracket"), ("n[[1]]", "nests"),
    ("n[2-1]", "runs backwards"), ("n[a-b]", "not N or N-M"), ("n1,,n2", "empty entry"), ("", "empty entry"),
    ("n[0-99999999]", "more than"), ("n$(reboot)", "not a host name"), ("n[1-300]m[1-300]", "more than"),
    ("n[ 1 ]", "not N or N-M"), ("n[\u0661-\u0663]", "not N or N-M"), ("a" + "[0-65535]" * 60, "more than"),
])
def test_a_bad_host_list_is_refused_naming_it(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why.replace("(", r"\(")):
        expand_hostlist(text)


@settings(deadline=None)  # a busy 2-core machine: hypothesis' 200 ms is no bound on correctness
@given(st.text(max_size=40))
def test_any_text_is_a_host_list_or_a_value_error(text: str) -> None:
    try:
        hosts = expand_hostlist(text)
    except ValueError:
        return
    assert 1 <= len(hosts) <= MAX_EXPANDED and all(isinstance(h, str) for h in hosts)


@settings(deadline=None)
@given(st.from_regex(r"[a-z]{1,4}", fullmatch=True), st.lists(st.integers(0, 300), min_size=1, max_size=12),
       st.integers(1, 3))
def test_a_compressed_list_expands_to_its_hosts(prefix: str, numbers: list[int], width: int) -> None:
    numbers = sorted(set(numbers))
    ranges = ",".join(str(n).zfill(width) for n in numbers)
    assert expand_hostlist(f"{prefix}[{ranges}]") == [prefix + str(n).zfill(width) for n in numbers]


@pytest.mark.parametrize(("text", "counts"), [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,2,3", [1, 2, 3])])
def test_tasks_per_node_expand(text: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["2(x0)", "x", "2(3)", "", "2(x99999999)"])
def test_bad_tasks_per_node_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="tasks per node"):
        expand_tasks_per_node(text)


def test_an_srun_task_reads_its_place_from_slurm() -> None:
    env = parse_launch_env(SRUN_TASK)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert (env.run_id, env.launched, env.restart_count) == ("slurm-2", True, 0)
    task = env.slurm_task
    assert task is not None and task.nodes == ("n1", "n2") and task.node_index == 1
    assert task.master_port == MASTER_PORT_BASE + 2


def test_steps_of_one_job_listen_on_ports_of_their_own() -> None:
    first, second = (parse_launch_env({**SRUN_TASK, "SLURM_STEP_ID": step}).slurm_task for step in ("0", "1"))
    assert first is not None and second is not None and first.master_port != second.master_port


def test_master_port_and_restart_count_come_from_the_environment_when_set() -> None:
    env = parse_launch_env({**SRUN_TASK, "MASTER_PORT": "29999", "SLURM_RESTART_COUNT": "3"})
    assert env.slurm_task is not None and env.slurm_task.master_port == 29999 and env.restart_count == 3


def test_a_batch_shell_is_not_a_task_and_torchruns_variables_win() -> None:
    assert not in_step(BATCH_SHELL) and parse_launch_env(BATCH_SHELL) == SINGLE_PROCESS
    torchrun = parse_launch_env({**SRUN_TASK, "RANK": "0", "WORLD_SIZE": "1"})
    assert torchrun.slurm_task is None and (torchrun.rank, torchrun.world_size) == (0, 1)


@pytest.mark.parametrize(("override", "message"), [
    ({"SLURM_PROCID": "4"}, "SLURM_PROCID=4 is outside the step's 4 tasks"),
    ({"SLURM_PROCID": "three"}, "SLURM_PROCID='three' is not an integer"),
    ({"SLURM_NODEID": "2"}, "SLURM_NODEID=2 is outside the step's 2 nodes"),
    ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID=2 is outside the 2 tasks on this node"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3)"}, "names 3 nodes, the step has 2"),
    ({"SLURM_STEP_NODELIST": "n[1-"}, "SLURM_STEP_NODELIST: host list"),
    ({"SLURM_STEP_NUM_TASKS": "0"}, "SLURM_STEP_NUM_TASKS=0 must be at least 1"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a port"),
    ({"SLURM_DISTRIBUTION": "arbitrary"}, "SLURM_DISTRIBUTION=arbitrary may put rank 0 on any node"),
])
def test_a_bad_slurm_variable_is_one_line_naming_it(override: dict[str, str], message: str) -> None:
    with pytest.raises(EnvironmentConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        parse_launch_env({**SRUN_TASK, **override})


def test_the_requeue_signal_is_usr1_inside_a_job_only_and_can_be_changed_or_off() -> None:
    assert requeue_signal({}) is None
    assert requeue_signal({"SLURM_JOB_ID": "7"}) == signal.SIGUSR1
    assert requeue_signal({"SLURM_JOB_ID": "7", "TORCHREVIVE_REQUEUE_SIGNAL": "sigusr2"}) == signal.SIGUSR2
    assert requeue_signal({"SLURM_JOB_ID": "7", "TORCHREVIVE_REQUEUE_SIGNAL": "none"}) is None
    with pytest.raises(UsageError, match="TORCHREVIVE_REQUEUE_SIGNAL='TERM' is not USR1, USR2 or none"):
        requeue_signal({"SLURM_JOB_ID": "7", "TORCHREVIVE_REQUEUE_SIGNAL": "TERM"})


# An agent's step: one task per node on two nodes whose names resolve here.
AGENT = {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "localhost,otherhost",
         "SLURMD_NODENAME": "localhost", "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}


def test_rdzv_endpoint_slurm_is_the_first_node_a_job_port_and_the_allocation() -> None:
    args = parse_args(["--rdzv-endpoint=slurm", "--nproc-per-node=1", "train.py"])
    expand_endpoint(args, AGENT, nnodes_given=args.nnodes is not None)
    assert (args.rdzv_endpoint, args.rdzv_backend, args.rdzv_id, args.nnodes) == (
        "localhost:21234", "c10d", "slurm-1234", "1:2")
    assert args.rdzv_conf == "is_host=true"  # the first node's agent hosts the store
    other = parse_args(["--rdzv-endpoint=slurm", "--nnodes=2:2", "--rdzv-id=mine", "--rdzv-conf=join_timeout=9",
                        "train.py"])
    expand_endpoint(other, {**AGENT, "SLURMD_NODENAME": "otherhost", "SLURM_NODEID": "1"}, nnodes_given=True)
    assert (other.nnodes, other.rdzv_id, other.rdzv_conf) == ("2:2", "mine", "join_timeout=9,is_host=false")


@pytest.mark.parametrize(("argv", "environ", "message"), [
    (["--rdzv-endpoint=slurm", "t.py"], {}, "needs a Slurm job"),
    (["--rdzv-endpoint=slurm", "--rdzv-backend=etcd-v3", "t.py"], AGENT, "needs an endpoint of its own"),
    (["--rdzv-endpoint=slurm:abc", "t.py"], AGENT, "'abc' is not a Slurm job id"),
    (["--rdzv-endpoint=slurm", "t.py"], {**AGENT, "SLURM_STEP_NODELIST": "n[1"}, "leaves a bracket open"),
    (["--rdzv-endpoint=slurm", "t.py"], {**AGENT, "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"},
     "one agent per node"),
])
def test_rdzv_endpoint_slurm_refuses_in_one_line(argv: list[str], environ: dict[str, str], message: str) -> None:
    args = parse_args(argv)
    with pytest.raises(UsageError, match=message):
        expand_endpoint(args, environ, nnodes_given=False)


def test_other_endpoints_are_left_alone() -> None:
    args = parse_args(["--rdzv-endpoint=h:1", "--rdzv-backend=c10d", "t.py"])
    expand_endpoint(args, AGENT, nnodes_given=False)
    assert (args.rdzv_endpoint, args.nnodes) == ("h:1", None)


def test_a_stop_signal_in_torchs_metrics_wrapper_before_its_start_time_is_sent_again(monkeypatch) -> None:
    """torch's `prof` wrapper fails with UnboundLocalError (hiding the signal) if its handler raises
    before `start` is assigned: there the signal is sent again later instead of raised."""
    import sys

    from torch.distributed.elastic.metrics.api import prof

    from elastic._agent.launcher import stop_signals

    seen: list[str] = []
    monkeypatch.setattr(stop_signals, "_send_again", lambda signum: seen.append("again"))
    safe = stop_signals.raise_safely(lambda signum, frame: seen.append("start" in frame.f_locals and "raised"))

    def tracer(frame, event, arg):
        if frame.f_code.co_name == "wrapper" and event == "line":
            safe(signal.SIGTERM, frame)  # as if the signal landed on each line of the wrapper
        return tracer

    sys.settrace(tracer)
    try:
        prof(lambda: None, group="test")()
    finally:
        sys.settrace(None)
    # The lines up to `start = time.time()` send it again; every line after it raises at once.
    assert seen[0] == "again" and "raised" in seen, seen
    assert seen == sorted(seen), seen  # "again" ... "again", "raised" ... "raised"


def test_the_agent_takes_the_requeue_signal_before_its_workers_start_as_a_stop_that_needs_no_note(
    monkeypatch, tmp_path
) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from elastic._agent.launcher import slurm_launch

    monkeypatch.setattr(slurm_launch.signal, "signal", lambda *args: None)  # no handler in the test process
    monkeypatch.setattr(slurm_launch.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    monkeypatch.setattr(slurm_launch.os, "environ", {})
    asked = []
    monkeypatch.setattr(slurm_launch, "requeue_after_preemption", lambda job: asked.append(job) or "requeued")
    first, other = ({"SLURM_JOB_ID": "12", "SLURM_PROCID": rank} for rank in ("0", "1"))
    agent = slurm_launch.RequeueSignal(first)
    agent._on_signal(signal.SIGUSR1, None)  # before launching: remembered, nothing raised
    with pytest.raises(SignalException):
        agent.launching()
    assert agent.requeue_if_first() == "requeued" and asked == [12]
    # Once workers ran, the first agent requeues only on a worker's note; the others never.
    late = slurm_launch.RequeueSignal(first)
    late.launching()
    with pytest.raises(SignalException):
        late._on_signal(signal.SIGUSR1, None)
    assert late.requeue_if_first().startswith("Slurm job 12 not requeued: no worker on this node")
    (tmp_path / "rank-1").write_text("17")
    assert late.requeue_if_first() == "requeued" and asked == [12, 12]
    elsewhere = slurm_launch.RequeueSignal(other)
    elsewhere.launching()
    with pytest.raises(SignalException):
        elsewhere._on_signal(signal.SIGUSR1, None)
    assert elsewhere.requeue_if_first() is None
