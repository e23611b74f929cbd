"""A job launched again with the same `--rdzv-id` resumes, on etcd-v3 and on c10d.

torch closes the rendezvous when a job ends. On etcd-v3 the closed state outlives
the job (it lives in etcd); the backend reopens a closed run once none of its
agents is alive, in one compare-and-set transaction, and the last agent of a job
that ends cleanly removes the run's keys itself (see `elastic._agent.rendezvous.etcd_reopen`).
The torchrun tests run real jobs; the others drive the backend's handlers in this
process (and one in a process that is SIGKILLed) against a real etcd.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from etcd_server import EtcdServer
from support import (
    REPO,
    TINY_MODEL,
    free_port,
    logs,
    start_agents,
    torchrun_command,
    wait_all,
    wait_for,
    worker_env,
)
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from elastic._agent.rendezvous import etcd
from elastic._agent.rendezvous.etcd_reopen import RunKeys, _remove_closed_run, reopen_closed_run
from elastic._agent.rendezvous.handlers import create_etcd_v3 as create_handler_v3
from elastic._shared.storage.peer_auth import SECRET_FILE_ENV, PeerKey
from elastic._worker.observe.events import read_events

pytestmark = pytest.mark.slow

RDZV_CONF = "join_timeout=60,last_call_timeout=1,close_timeout=5,read_timeout=30"


@pytest.fixture(autouse=True)
def job_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's secret, given as a user gives it (the handlers made in this process read it, and so do
    the agents this test starts)."""
    secret = tmp_path / "job-secret"
    secret.write_text("j" * 32)
    monkeypatch.setenv(SECRET_FILE_ENV, str(secret))


def create_backend(p: RendezvousParameters):  # noqa: ANN201 - etcd.create_backend's
    """The backend and store of an agent of the job, its state sealed with the job's secret."""
    return etcd.create_backend(p, PeerKey.from_env(os.environ))


def params(endpoint: str, run_id: str, **conf: str) -> RendezvousParameters:
    conf = {"read_timeout": "10", "liveness_ttl": "2", "join_timeout": "30", **conf}
    return RendezvousParameters("etcd-v3", endpoint, run_id, 1, 2, local_addr="127.0.0.1", **conf)


def run_keys(server: EtcdServer, run_id: str) -> list[str]:
    return server.keys(f"/torchrevive/{run_id}/")


def launch(tmp_path: Path, name: str, agents: int, command: list[str]) -> list[int]:
    """Run `agents` identical agents to their end; their exit codes."""
    directory = tmp_path / name
    directory.mkdir()
    procs = start_agents(agents, command, directory)
    try:
        return wait_all(procs, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name}: agents still running after 180 s:\n{logs(directory, 'agent*.log')}")


def recipe_args(corpus: Path, tmp_path: Path, steps: int) -> list[str]:
    return ["--data", str(corpus), "--max-steps", str(steps), "--eval-every", "0", "--events",
            str(tmp_path / "events.jsonl"), "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "5", *TINY_MODEL]


def assert_resumed(tmp_path: Path, first: int, last: int) -> None:
    records = list(read_events(tmp_path / "events.jsonl"))
    assert [e["step"] for e in records if e["event"] == "end"] == [first, last]
    restores = [e for e in records if e["event"] == "restore"]
    assert [(e["step"], e["checkpoint"]) for e in restores] == [(first, f"step_{first:08d}")], restores
    steps = [e["step"] for e in records if e["event"] == "step"]
    assert steps == list(range(1, last + 1)), "the relaunch did not continue where the first launch ended"


# --- real jobs ------------------------------------------------------------------------


def test_etcd_v3_job_relaunched_with_the_same_id_resumes(tmp_path: Path, tiny_corpus: Path, shared_etcd: EtcdServer) -> None:
    run_id = uuid.uuid4().hex

    def command(steps: int) -> list[str]:
        return torchrun_command(nnodes="2", port=0, run_id=run_id, backend="etcd-v3", endpoint=shared_etcd.endpoint,
                                rdzv_conf=RDZV_CONF, script_args=recipe_args(tiny_corpus, tmp_path, steps))

    assert launch(tmp_path, "first", 2, command(10)) == [0, 0], logs(tmp_path / "first", "agent*.log")
    assert run_keys(shared_etcd, run_id) == [], "the last agent out should have removed the finished run's keys"
    assert launch(tmp_path, "second", 2, command(20)) == [0, 0], logs(tmp_path / "second", "agent*.log")
    assert_resumed(tmp_path, 10, 20)


def test_c10d_job_relaunched_with_the_same_id_resumes(tmp_path: Path, tiny_corpus: Path) -> None:
    """c10d keeps its rendezvous in the first agent's process: a relaunch starts afresh."""
    port = free_port()

    def command(steps: int) -> list[str]:
        return torchrun_command(nnodes="1", port=port, run_id="relaunch", rdzv_conf=RDZV_CONF,
                                script_args=recipe_args(tiny_corpus, tmp_path, steps))

    assert launch(tmp_path, "first", 1, command(10)) == [0], logs(tmp_path / "first", "agent*.log")
    assert launch(tmp_path, "second", 1, command(20)) == [0], logs(tmp_path / "second", "agent*.log")
    assert_resumed(tmp_path, 10, 20)


# --- the backend against a real etcd ------------------------------------------------------

CLOSE_AND_HANG = """
import sys, time
from torch.distributed.elastic.rendezvous.api import RendezvousParameters
from elastic._agent.rendezvous.etcd import create_backend
from elastic._agent.rendezvous.handlers import create_etcd_v3
p = RendezvousParameters("etcd-v3", sys.argv[1], sys.argv[2], 1, 2, read_timeout="10", liveness_ttl="2")
handler = create_etcd_v3(p)
_, store = create_backend(p, None)
store.set("torch.rendezvous.%s.0/MASTER_PORT" % sys.argv[2], "1234")
handler.set_closed()
print("closed", flush=True)
time.sleep(600)
"""


def closing_agent(server: EtcdServer, run_id: str) -> subprocess.Popen:
    """An agent (its own process) that closed the run and is still alive."""
    agent = subprocess.Popen([sys.executable, "-c", CLOSE_AND_HANG, server.endpoint, run_id], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=worker_env(), cwd=REPO)
    line = agent.stdout.readline()
    if line.strip() != "closed":
        agent.kill()
        pytest.fail(f"the closing agent failed: {agent.communicate()[1][-3000:]}")
    return agent


def test_a_run_closed_by_agents_that_were_sigkilled_is_reopened_once_their_keys_expire(
    shared_etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    run_id = uuid.uuid4().hex
    agent = closing_agent(shared_etcd, run_id)
    os.kill(agent.pid, signal.SIGKILL)  # no clean exit: its agent key is left to its 2 s lease
    agent.wait()
    assert any("/agents/" in key for key in run_keys(shared_etcd, run_id))

    handler = create_handler_v3(params(shared_etcd.endpoint, run_id, last_call_timeout="1"))
    try:
        # the new agent's own: its agent key and its node's heartbeat (and this handler's change counter)
        keys = [k for k in run_keys(shared_etcd, run_id) if not k.endswith(".changes")]
        assert len(keys) == 2 and "/agents/" in keys[0] and "/alive/" in keys[1], f"the dead job's keys are left: {keys}"
        info = handler.next_rendezvous()  # the reopened run takes a new job
        assert (info.rank, info.world_size, handler.is_closed()) == (0, 1, False)
    finally:
        handler.shutdown()
    assert run_keys(shared_etcd, run_id) == []


def test_a_closed_run_whose_agent_is_alive_is_not_reopened(shared_etcd: EtcdServer) -> None:
    run_id = uuid.uuid4().hex
    agent = closing_agent(shared_etcd, run_id)
    try:
        backend, _ = create_backend(params(shared_etcd.endpoint, run_id))
        before = backend.get_state()
        with pytest.raises(RendezvousClosedError, match=r"closed and 1 agent\(s\) of the job that closed it are still running"):
            create_handler_v3(params(shared_etcd.endpoint, run_id, join_timeout="2"))
        assert backend.get_state() == before, "the live job's closed state was touched"
    finally:
        agent.kill()
        agent.wait()


def test_a_relauncher_waits_for_the_closing_job_to_exit_then_reopens(shared_etcd: EtcdServer) -> None:
    run_id = uuid.uuid4().hex
    closer = create_handler_v3(params(shared_etcd.endpoint, run_id))
    closer.set_closed()
    relaunched: list[object] = []
    relauncher = threading.Thread(target=lambda: relaunched.append(create_handler_v3(params(shared_etcd.endpoint, run_id))))
    relauncher.start()
    time.sleep(1.5)
    assert relauncher.is_alive(), "the relauncher reopened a run whose closing agent is alive"
    closer.shutdown()  # a clean exit: its agent key goes at once
    relauncher.join(30)
    assert relaunched and not relaunched[0].is_closed()
    relaunched[0].shutdown()


def test_the_last_agent_out_removes_the_run_and_the_others_leave_it_closed(
    shared_etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    run_id = uuid.uuid4().hex
    first = create_handler_v3(params(shared_etcd.endpoint, run_id))
    second = create_handler_v3(params(shared_etcd.endpoint, run_id))
    joining = [threading.Thread(target=handler.next_rendezvous) for handler in (first, second)]
    for thread in joining:  # a round of the two, full at 2: the agents of one launch
        thread.start()
    for thread in joining:
        thread.join(60)
    assert first.shutdown()
    keys = run_keys(shared_etcd, run_id)
    assert f"/torchrevive/{run_id}/rdzv/state" in keys, "the state vanished under an agent still winding down"
    wait_for(lambda: second.is_closed() or None, 10, "the closed state, past torch's 1 s cache of the state")
    assert second.shutdown()
    assert run_keys(shared_etcd, run_id) == []


def test_reopen_with_the_same_token_succeeds_once(shared_etcd: EtcdServer) -> None:
    """Two relaunchers that saw the same closed state: one transaction wins."""
    run_id = uuid.uuid4().hex
    backend, store = create_backend(params(shared_etcd.endpoint, run_id))
    create_handler(store, backend, params(shared_etcd.endpoint, run_id)).set_closed()  # closed, no agent key
    _, token = backend.get_state()
    keys = RunKeys(f"/torchrevive/{run_id}".encode())
    assert [_remove_closed_run(backend.client, keys, token) for _ in range(2)] == [True, False]
    assert backend.get_state() is None


def test_concurrent_relaunchers_both_get_an_open_run(shared_etcd: EtcdServer) -> None:
    run_id = uuid.uuid4().hex
    backend, store = create_backend(params(shared_etcd.endpoint, run_id))
    create_handler(store, backend, params(shared_etcd.endpoint, run_id)).set_closed()
    reopened: list[bool] = []
    barrier = threading.Barrier(2)

    def relaunch() -> None:
        mine, my_store = create_backend(params(shared_etcd.endpoint, run_id))
        barrier.wait()
        reopened.append(reopen_closed_run(mine, my_store, params(shared_etcd.endpoint, run_id), keys, timeout=10))

    keys = RunKeys(f"/torchrevive/{run_id}".encode())
    threads = [threading.Thread(target=relaunch) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(reopened) == [False, True]
    assert backend.get_state() is None


def test_an_open_run_is_left_alone(shared_etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    run_id = uuid.uuid4().hex
    running = create_handler_v3(params(shared_etcd.endpoint, run_id, last_call_timeout="1"))
    try:
        assert (running.next_rendezvous().rank, running.is_closed()) == (0, False)
        backend, store = create_backend(params(shared_etcd.endpoint, run_id))
        before = backend.get_state()
        keys = RunKeys(f"/torchrevive/{run_id}".encode())
        assert not reopen_closed_run(backend, store, params(shared_etcd.endpoint, run_id), keys, timeout=1)
        assert backend.get_state() == before
    finally:
        running.shutdown()
