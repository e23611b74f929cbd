"""Strangers who reach a running torchrevive-run job's c10d rendezvous store (the run id and the port are
all it takes) write every probe of issue 55 into it, through a job that loses a worker and forms a second
round, and again and again until it ends. The job's secret is given as a user gives it (a file every
agent names). None of it is read: the job trains on at its world size to its end, no agent exits early,
none prints a traceback, and nothing a stranger wrote is unpickled.

The probes (a raw TCPStore client, as an attacker on loopback):
- torch's pickled state carrying a payload that makes a directory, in torch's own encoding at torch's
  own key, every 0.2 s (a signed job's state lies at a key the secret names: it is never read);
- at that key, a closing state and an open one, sealed as an earlier launch of the same run id and
  secret sealed its states a minute ago (what a stranger could have recorded from it: same secret, same
  run id, same key, another launch id), and that launch's crash-loop notice in the board's first slot;
- for the next rounds, before the job reaches them: forged assigned ranks (`[0, 1, 0, 1]`: a second rank
  0) and a foreign MASTER_ADDR and MASTER_PORT;
- `x` in the rendezvous' change counter (it ended every agent with a traceback);
- unsigned notices: a hang naming rank 1 (its agent would end it) and a crash loop (every agent would stop);
- a stranger's address for rank 1 in each round's worker store, before rank 1 writes its own.
"""

from __future__ import annotations

import base64
import os
import pickle
import random
import re
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch.distributed as dist
from support import TINY_MODEL, free_port, make_text, start_agents, torchrun_command, wait_all, worker_env
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from elastic._agent.launcher.notice_board import Entry, StoreBoard
from elastic._agent.rendezvous.state_seal import StateSeal
from elastic._shared.protocol import round_identity
from elastic._shared.storage.peer_auth import SECRET_FILE_ENV, PeerKey
from elastic._shared.storage.sealed_store import SealedStore, peek
from elastic._worker.observe.events import read_events

pytestmark = pytest.mark.slow

RUN = "strangers"
EARLIER = "e" * 32
"""The launch id of the earlier launch whose values the stranger recorded."""


class Marker:
    """Unpickling it makes a directory: it names only `posix.mkdir`, which any agent can import."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (str(self.path),))


def recorded_states(key: PeerKey) -> list[bytes]:
    """States sealed as the earlier launch sealed them, recorded a minute before: closed (its end), and open."""
    node, then = _NodeDesc("10.0.0.9", 4242, 0), datetime.now(timezone.utc) - timedelta(seconds=60)
    closed, stale = _RendezvousState(), _RendezvousState()
    closed.closed, closed.round, closed.participants, closed.last_heartbeats = True, 3, {node: 0}, {node: then}
    stale.round, stale.complete, stale.participants, stale.last_heartbeats = 9, True, {node: 0}, {node: then}
    return [StateSeal(RUN, key).seal(pickle.dumps(state), 40 + i, EARLIER) for i, state in enumerate((closed, stale))]


def recorded_crash_loop(secret: Path) -> bytes:
    """The earlier launch's crash-loop notice, as its board left it in the store."""
    store = SealedStore(dist.HashStore(), PeerKey.from_file(secret), round_identity.rendezvous_scope(RUN, EARLIER))
    StoreBoard(store, RUN, {SECRET_FILE_ENV: str(secret)}).post(
        Entry("crash_loop", "crash loop: the job failed 3 times in a row after step 4", 1.0, 4, 2, "node-a", {}))
    return dist.PrefixStore(f"torchrevive/notices/{RUN}/", store.inner).get("n1")


def unsigned_notice(kind: str, **fields: object) -> bytes:
    return Entry(kind, f"{kind}: a stranger's", 1e10, 5, 2, "node-x", dict(fields)).dumps().encode()


class Stranger:
    """Writes the probes of the module docstring into the store at `port`, every 0.2 s, until `stop`."""

    def __init__(self, port: int, secret: Path | None, marker: Path) -> None:
        """`secret`: the job's, to make what the stranger recorded from its earlier launch (None: no recordings)."""
        self.port = port
        self.payload = base64.b64encode(pickle.dumps(Marker(marker)))
        self.recorded: list[bytes] = []
        """States recorded from an earlier launch, and the key they lay at (none without the secret)."""
        self.recorded_key = ""
        self.notices = {"n2": unsigned_notice("hang", culprits=[1], nodes=["x"]), "n3": unsigned_notice("crash_loop", rank=1)}
        if secret is not None:
            key = PeerKey.from_file(secret)
            self.recorded = [base64.b64encode(state) for state in recorded_states(key)]
            self.recorded_key = StateSeal(RUN, key).store_key()
            self.notices["n1"] = recorded_crash_loop(secret)
        self.stop = threading.Event()
        self.wrote: dict[str, int] = {}
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        store = None
        while store is None and not self.stop.is_set():
            try:
                store = dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=5))
            except (RuntimeError, TimeoutError):
                self.stop.wait(0.1)
        turn = 0
        while not self.stop.wait(0.2):
            turn += 1
            try:
                self.write(store, turn)
            except Exception:  # noqa: BLE001, S112 - the store goes away with the job; the stranger tries again
                continue

    def count(self, what: str) -> None:
        self.wrote[what] = self.wrote.get(what, 0) + 1

    def write(self, store: dist.TCPStore, turn: int) -> None:
        store.set(f"torch.rendezvous.{RUN}", self.payload)  # the state, as torch's backend writes it
        self.count("state")
        if self.recorded and turn % 2 and store.check([self.recorded_key]):  # written back over the job's
            store.set(self.recorded_key, self.recorded[turn // 2 % len(self.recorded)])
            self.count("recorded state")
        store.set(f"torchrevive.rdzv.{RUN}.changes", "x")
        self.count("changes")
        for number in range(5):  # the next rounds, before the job reaches them: written only where nothing is
            prefix = f"torch.rendezvous.{RUN}.{number}/"
            for name, value in (("torchelastic/assigned_ranks/0", "[0, 1, 0, 1]"),
                                ("torchelastic/assigned_ranks/1", "[0, 1, 0, 1]"),
                                ("MASTER_ADDR", "10.255.255.1"), ("MASTER_PORT", "1")):
                if store.compare_set(prefix + name, "", value) == value.encode():
                    self.count("round keys")
            self.forge_worker_address(store, prefix)
        for name, value in self.notices.items():
            if store.compare_set(f"torchrevive/notices/{RUN}//{name}", "", value) == value:
                self.count("notices")

    def forge_worker_address(self, store: dist.TCPStore, prefix: str) -> None:
        """Rank 1's address in the round's worker store (found through the round's MASTER_PORT, which is
        sealed, not secret), if the round has one and rank 1 has not written it yet."""
        if not store.check([prefix + "MASTER_PORT"]):
            return
        port = peek(store.get(prefix + "MASTER_PORT"))
        if not port.isdigit() or int(port) in (0, 1, self.port):
            return
        try:
            workers = dist.TCPStore("127.0.0.1", int(port), is_master=False, timeout=timedelta(seconds=1))
        except (RuntimeError, TimeoutError):
            return
        if workers.compare_set("0//cpu//0/1", "", b"\x02\x00\x05\x39\x7f\x00\x00\x01") != b"":
            self.count("worker address")


def test_strangers_in_the_rendezvous_store_neither_stop_stall_nor_redirect_a_signed_job(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_text(random.Random(5), 20_000))
    secret = tmp_path / "secret"
    secret.write_text("ab" * 32)
    secret.chmod(0o600)
    port, marker, events = free_port(), tmp_path / "marker", tmp_path / "events.jsonl"
    command = torchrun_command(
        nnodes="2:2", port=port, run_id=RUN, max_restarts=2, script_args=[
            "--data", str(corpus), "--max-steps", "30", "--eval-every", "0", "--ckpt-dir", str(tmp_path / "ckpt"),
            "--ckpt-every", "10", "--events", str(events), *TINY_MODEL],
    )
    command[1:3] = ["-m", "elastic._agent.launcher"]
    env = worker_env(TORCHREVIVE_SNAPSHOT_SECRET_FILE=str(secret), TORCHREVIVE_SNAPSHOT_BASE=str(tmp_path / "shm"),
                     # A second round (rank 1 killed after step 8): the probes of round 1 meet the job too. Every
                     # step paced to 0.15 s: the stranger writes every 0.2 s, and a job of 30 tiny steps was over in
                     # a second on an idle machine, before it had written each probe three times.
                     ELASTIC_FAULT="after_step@8:rank=1,after_step@1+:do=slow:for=0.15:restart=any")
    stranger = Stranger(port, secret, marker)
    agents = start_agents(2, command, tmp_path, env=env)
    stranger.thread.start()
    try:
        codes = wait_all(agents, timeout=300)
    finally:
        stranger.stop.set()
        stranger.thread.join(30)
    log = "\n".join((tmp_path / f"agent{i}.log").read_text(errors="replace") for i in range(2))
    assert stranger.wrote.get("state", 0) >= 3 and stranger.wrote.get("changes", 0) >= 3, stranger.wrote
    assert stranger.wrote.get("recorded state", 0) >= 2, stranger.wrote
    assert stranger.wrote.get("round keys", 0) >= 4 and stranger.wrote.get("notices", 0) >= 1, stranger.wrote
    assert codes == [0, 0], log[-6000:]
    assert not marker.exists(), "an agent unpickled the stranger's payload"
    # (torch prints the collateral failure's traceback of the killed worker's peer: that is the fault's, not a probe's)
    tracebacks = [line for line in log.splitlines() if "Traceback" in line and not re.match(r"E\d{4} ", line)]
    assert not tracebacks, log[-6000:]
    recorded = list(read_events(events))
    steps = [e for e in recorded if e["event"] == "step"]
    assert steps[-1]["step"] == 30 and {e["world_size"] for e in steps} == {2}, steps[-3:]
    failures = [e for e in recorded if e["event"] == "failure"]
    assert [e["rank"] for e in failures if e["primary"]] == [1], failures  # the fault's, and nothing a stranger forged
    assert not [e for e in recorded if e["event"] in ("hang", "crash_loop")]
    assert "never unpickled" in log
    refused = set(re.findall(r"store key (\S+) holds a value not sealed with the job's secret", log))
    assert {f"torchrevive.rdzv.{RUN}.changes", f"torchrevive/notices/{RUN}//n1"} <= refused, refused
    assert not re.search(r"ending worker rank \d+ .*the hang's culprit", log)


def test_plain_torchrun_on_the_sealed_backend_never_runs_a_strangers_pickle(tmp_path: Path) -> None:
    """`torchrun --rdzv-backend=c10d-sealed` (the README's plain-torchrun line): the pickled payload that ran in
    every agent of torch's own c10d backend is refused, and so is the rest; a job on one host signs with a
    secret its host makes, with nothing to give."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_text(random.Random(6), 20_000))
    port, marker, events = free_port(), tmp_path / "marker", tmp_path / "events.jsonl"
    command = torchrun_command(nnodes="2:2", port=port, run_id=RUN, backend="c10d-sealed", script_args=[
        "--data", str(corpus), "--max-steps", "8", "--eval-every", "0", "--events", str(events), *TINY_MODEL])
    env = worker_env(TORCHREVIVE_SNAPSHOT_BASE=str(tmp_path / "shm"))
    env.pop(SECRET_FILE_ENV, None)
    stranger = Stranger(port, None, marker)
    agents = start_agents(2, command, tmp_path, env=env)
    stranger.thread.start()
    try:
        codes = wait_all(agents, timeout=300)
    finally:
        stranger.stop.set()
        stranger.thread.join(30)
    log = "\n".join((tmp_path / f"agent{i}.log").read_text(errors="replace") for i in range(2))
    assert stranger.wrote.get("state", 0) >= 1 and stranger.wrote.get("changes", 0) >= 1, stranger.wrote
    assert codes == [0, 0], log[-6000:]
    assert not marker.exists(), "an agent unpickled the stranger's payload"
    assert "Traceback" not in log, log[-6000:]
    assert "never unpickled" not in log  # the state lies at a key the secret names: torch's key is never read
    steps = [e for e in read_events(events) if e["event"] == "step"]
    assert steps[-1]["step"] == 8 and {e["world_size"] for e in steps} == {2}
