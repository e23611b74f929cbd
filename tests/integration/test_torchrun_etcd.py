"""Real torchrun jobs whose agents meet through `--rdzv-backend=etcd-v3` and a real etcd."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import warm
from etcd_server import EtcdServer, make_tls
from support import (
    REPO,
    TINY_MODEL,
    children_of,
    free_port,
    logs,
    steps_seen,
    stop_all,
    torchrun_command,
    wait_all,
    wait_for,
    worker_env,
    worker_rank,
)
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousParameters,
)

from elastic._agent.rendezvous.etcd import create_backend
from elastic._worker.observe.events import read_events

pytestmark = pytest.mark.slow

RDZV_CONF = "join_timeout=60,last_call_timeout=2,close_timeout=5,read_timeout=30"


def _params(endpoint: str, **conf: str) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, uuid.uuid4().hex, 1, 1, read_timeout="5", **conf)


def agent(command: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return warm.popen(command, stdout=out, stderr=subprocess.STDOUT, env=worker_env(), cwd=REPO)


def etcd_command(endpoint: str, run_id: str, nnodes: str, script_args: list[str], *, max_restarts: int = 0,
                 conf: str = RDZV_CONF) -> list[str]:
    return torchrun_command(
        nnodes=nnodes, port=0, run_id=run_id, backend="etcd-v3", endpoint=endpoint,
        rdzv_conf=conf, max_restarts=max_restarts, script_args=script_args,
    )


def recipe_args(corpus: Path, events: Path, steps: int, *extra: str) -> list[str]:
    return ["--data", str(corpus), "--max-steps", str(steps), "--eval-every", "0", "--events", str(events),
            *TINY_MODEL, *extra]



def finish(agents: list[subprocess.Popen], directory: Path, timeout: float = 180) -> list[int]:
    """The agents' exit codes; on a timeout, fail with their logs (then they are killed)."""
    try:
        return wait_all(agents, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"agents still running after {timeout} s:\n{logs(directory, 'agent*.log')}")



def test_two_agents_meet_on_etcd_with_a_dead_endpoint_listed_first(
    tmp_path: Path, tiny_corpus: Path, shared_etcd: EtcdServer
) -> None:
    run_id = uuid.uuid4().hex
    events = tmp_path / "events.jsonl"
    args = recipe_args(tiny_corpus, events, 20)
    dead = f"127.0.0.1:{free_port()}"
    agents = [
        agent(etcd_command(f"{dead},{shared_etcd.endpoint}", run_id, "2", args), tmp_path / "agent0.log"),
        agent(etcd_command(shared_etcd.endpoint, run_id, "2", args), tmp_path / "agent1.log"),
    ]
    assert finish(agents, tmp_path) == [0, 0], logs(tmp_path, "agent*.log")
    recorded = list(read_events(events))
    assert {e["world_size"] for e in recorded} == {2}
    assert [e["step"] for e in recorded if e["event"] == "step"] == list(range(1, 21))
    keys = shared_etcd.keys(f"/torchrevive/{run_id}/")
    assert keys == [], "the last agent out removes the finished run's keys (a relaunch starts afresh)"


def test_sigkilled_worker_recovers_with_nnodes_1_to_3(tmp_path: Path, tiny_corpus: Path, shared_etcd: EtcdServer) -> None:
    run_id = uuid.uuid4().hex
    events = tmp_path / "events.jsonl"
    steps = 60
    args = recipe_args(tiny_corpus, events, steps, "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "10")
    command = etcd_command(shared_etcd.endpoint, run_id, "1:3", args, max_restarts=3)
    agents = [agent(command, tmp_path / f"agent{i}.log") for i in range(2)]
    try:
        wait_for(lambda: steps_seen(events) >= 25, 120, "step 25", interval=0.005)
        victim = next(pid for a in agents for pid in children_of(a.pid) if worker_rank(pid) == 1)
        os.kill(victim, signal.SIGKILL)
    except BaseException:
        stop_all(agents)
        raise
    assert finish(agents, tmp_path, 240) == [0, 0], logs(tmp_path, "agent*.log")
    recorded = list(read_events(events))
    restores = [e for e in recorded if e["event"] == "restore"]
    assert restores and restores[-1]["step"] >= 20, logs(tmp_path, "agent*.log")
    (end,) = [e for e in recorded if e["event"] == "end"]
    assert end["step"] == steps and end["world_size"] == 2


def test_job_survives_an_etcd_restart(tmp_path: Path, tiny_corpus: Path, etcd: EtcdServer) -> None:
    run_id = uuid.uuid4().hex
    events, go = tmp_path / "events.jsonl", tmp_path / "go"
    args = recipe_args(tiny_corpus, events, 40)
    command = etcd_command(etcd.endpoint, run_id, "2", args)
    # Rank 0 holds after step 21 until etcd is back: the outage lands mid-run however fast the job is.
    agents = [warm.popen(command, stdout=open(tmp_path / f"agent{i}.log", "wb"), stderr=subprocess.STDOUT,
                               env=worker_env(ELASTIC_FAULT=f"after_step@21:do=hold:until={go}"), cwd=REPO)
              for i in range(2)]
    try:
        wait_for(lambda: Path(f"{go}.held").exists(), 120, "rank 0 to hold after step 21", interval=0.01)
        etcd.stop()
        time.sleep(3)  # the outage itself: the agents' monitors poll etcd every 0.5 s and find it gone
        etcd.start()
        restarted_at = time.time()
        assert all(a.poll() is None for a in agents), "the job ended during the outage"
        go.touch()
    except BaseException:
        stop_all(agents)
        raise
    assert finish(agents, tmp_path, 240) == [0, 0], logs(tmp_path, "agent*.log")
    recorded = list(read_events(events))
    (end,) = [e for e in recorded if e["event"] == "end"]
    assert end["step"] == 40 and end["time"] > restarted_at
    assert "etcd at" in logs(tmp_path, "agent*.log") and "reconnected" in logs(tmp_path, "agent*.log"), "no agent noticed the outage"


def test_unreachable_etcd_fails_fast_naming_the_endpoint(tmp_path: Path, tiny_corpus: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    command = etcd_command(endpoint, "unreachable", "1", recipe_args(tiny_corpus, tmp_path / "e.jsonl", 5),
                           conf="read_timeout=3")
    done = warm.run(command, timeout=120, env=worker_env(), cwd=REPO)
    assert done.returncode != 0
    # It gave up at its read_timeout, not at torch's or the client's own default.
    assert re.search(rf"cannot reach etcd at {endpoint} to .* within 3 s", done.stderr), done.stderr[-3000:]


def test_tls_client_certificates_and_etcd_auth(tmp_path: Path, tiny_corpus: Path) -> None:
    tls = make_tls(tmp_path / "pki")
    server = EtcdServer(tmp_path / "etcd-data", tls=tls)
    server.start()
    try:
        server.enable_auth(root_password="s3cret")
        password_file = tmp_path / "etcd-password"
        password_file.write_text("s3cret\n")
        tls_conf = f"protocol=https,ca_cert={tls.ca},ssl_cert={tls.client_cert},ssl_cert_key={tls.client_key}"
        run_id = uuid.uuid4().hex
        events = tmp_path / "events.jsonl"
        command = etcd_command(
            server.endpoint, run_id, "1", recipe_args(tiny_corpus, events, 5),
            conf=f"{RDZV_CONF},{tls_conf},user=root,password_file={password_file}",
        )
        done = warm.run(command, timeout=120, env=worker_env(), cwd=REPO)
        assert done.returncode == 0, done.stderr[-3000:]
        assert [e["step"] for e in read_events(events) if e["event"] == "end"] == [5]
        keys = server.keys(f"/torchrevive/{run_id}/", user=("root", "s3cret"))
        assert keys == [], "the last agent out removes the finished run's keys, through TLS and auth"

        wrong_file = tmp_path / "wrong-password"
        wrong_file.write_text("wrong\n")
        wrong = etcd_command(server.endpoint, "wrong", "1", recipe_args(tiny_corpus, tmp_path / "w.jsonl", 5),
                             conf=f"read_timeout=5,{tls_conf},user=root,password_file={wrong_file}")
        done = subprocess.run(wrong, capture_output=True, text=True, timeout=120, env=worker_env(), cwd=REPO)
        assert done.returncode != 0
        assert "rejected user 'root'" in done.stderr, done.stderr[-3000:]

        inline = etcd_command(server.endpoint, "inline", "1", recipe_args(tiny_corpus, tmp_path / "i.jsonl", 5),
                              conf=f"read_timeout=5,{tls_conf},user=root,password=s3cret")
        done = subprocess.run(inline, capture_output=True, text=True, timeout=120, env=worker_env(), cwd=REPO)
        assert done.returncode == 2, done.stderr[-3000:]
        assert "give password_file=PATH instead" in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]

        login = {"user": "root", "password_file": str(password_file)}
        no_client_cert = _params(server.endpoint, protocol="https", ca_cert=str(tls.ca), **login)
        with pytest.raises(RendezvousConnectionError, match="TLS failed"):
            create_backend(no_client_cert)
        other_ca = make_tls(tmp_path / "other-pki")
        wrong_ca = _params(server.endpoint, protocol="https", ca_cert=str(other_ca.ca), ssl_cert=str(tls.client_cert),
                           ssl_cert_key=str(tls.client_key), **login)
        with pytest.raises(RendezvousConnectionError, match="TLS failed.*(CERTIFICATE_VERIFY_FAILED|verify failed)"):
            create_backend(wrong_ca)
    finally:
        server.stop()
