"""A stranger on the network writes a pickled payload into a running torchrevive-run job's c10d
rendezvous store, under the key and in the encoding torch's own C10dRendezvousBackend uses (the
run id and the port are all it takes): no agent runs it, and the job trains to its end."""

from __future__ import annotations

import os
import pickle
import random
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from support import (
    TINY_MODEL,
    free_port,
    make_text,
    start_agents,
    torchrun_command,
    wait_all,
    worker_env,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
    C10dRendezvousBackend,
)

pytestmark = pytest.mark.slow


class Marker:
    """Unpickling it makes a directory: it names only `posix.mkdir`, which any agent can import."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (str(self.path),))


def write_payloads(port: int, run_id: str, payload: bytes, stop: threading.Event, written: list[int]) -> None:
    """As torch's backend writes a state: base64 under `torch.rendezvous.<run id>`, compare-and-set
    on what the store holds; again every 0.2 s, through the rendezvous, the training and the end."""
    store = None
    while store is None and not stop.is_set():
        try:
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
        except (RuntimeError, TimeoutError):
            stop.wait(0.1)
    while not stop.wait(0.2):
        try:
            if not store.check([f"torch.rendezvous.{run_id}"]):
                continue
            stranger = C10dRendezvousBackend(store, run_id)
            current = stranger.get_state()
            if stranger.set_state(payload, None if current is None else current[1]) is not None:
                written.append(1)
        except Exception:  # noqa: BLE001, S112 - the store goes away with the job; the stranger just tries again
            continue


def test_a_strangers_pickled_state_is_never_run_and_the_job_trains_to_its_end(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_text(random.Random(5), 20_000))
    secret = tmp_path / "secret"
    secret.write_text("ab" * 32)
    secret.chmod(0o600)
    port, run_id, marker = free_port(), "stranger", tmp_path / "marker"
    command = torchrun_command(
        nnodes="2:2", port=port, run_id=run_id, script_args=[
            "--data", str(corpus), "--max-steps", "40", "--eval-every", "0", "--ckpt-dir", str(tmp_path / "ckpt"),
            "--ckpt-every", "20", "--events", str(tmp_path / "events.jsonl"), *TINY_MODEL],
    )
    command[1:3] = ["-m", "elastic._agent.launcher"]
    env = worker_env(TORCHREVIVE_SNAPSHOT_SECRET_FILE=str(secret), TORCHREVIVE_SNAPSHOT_BASE=str(tmp_path / "shm"))
    stop, written = threading.Event(), []
    stranger = threading.Thread(target=write_payloads, args=(port, run_id, pickle.dumps(Marker(marker)), stop, written))
    agents = start_agents(2, command, tmp_path, env=env)
    stranger.start()
    try:
        codes = wait_all(agents, timeout=240)
    finally:
        stop.set()
        stranger.join(30)
    log = "\n".join((tmp_path / f"agent{i}.log").read_text(errors="replace") for i in range(2))
    print(log[-4000:], file=sys.stderr)
    assert len(written) >= 3, "the stranger never reached the store"
    assert not marker.exists(), "an agent unpickled the stranger's payload"
    assert codes == [0, 0], log[-4000:]
    assert "never unpickled: it names posix.mkdir" in log or "it is not signed with the job's secret" in log
    assert "Traceback" not in log
