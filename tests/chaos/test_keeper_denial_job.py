"""Idle strangers at the snapshot keepers do not stop a restore from memory (#40 done-when).

A real two-node `torchrevive-run` job (the chaos harness), snapshots every step. Once
snapshots exist, a stranger holds 40 idle connections to EACH node's keeper (from 40
loopback addresses of its own; half send nothing, half a request line without the end of
its headers), more than a keeper's 32 slots, and opens a fresh one whenever a keeper shuts
one. The job trains on through them, so every replica copied to the other node goes
through the crowd. Each node's own parts of the newest step are then removed (each rank's
part now lies only in the other node's memory), rank 0's worker is killed, and as the
restarted group is about to read (ELASTIC_FAULT point before_read) the stranger opens its
80 connections afresh, so they hold the keepers' slots when the group fetches its parts.
The group restores from the peers' memory, not from disk, and the job ends at its last step.

Without the eviction of unsigned connections (keeper_slots.py; the keeper endpoint before
c009980) the replicas are refused (503) and the wait for them times out, or, if one slips
through while the keepers shut idle connections, the restore's fetch is refused and the
group restores from disk.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import warm
from peer_restore import (
    go_files,
    job_spec,
    node_memory,
    only_on_peers,
    restart_restore,
    wait_settled,
)
from support import wait_for

from elastic._worker.observe.events import read_events
from elastic.chaos.harness import ChaosJob

pytestmark = pytest.mark.slow

STEPS = 24
CROWD_AFTER = 4
"""Rank 0 holds after this step while the stranger's connections open (snapshots exist by then)."""
HOLD_AFTER = 12
"""Rank 0 holds after this step: its snapshot, copied through the crowd, is the one restored."""
IDLE = 40
"""Idle connections to each keeper, more than its 32 slots."""
REOPEN_AFTER = 1.0
"""Seconds before the stranger replaces a connection a keeper shut (a persistent stranger, not a storm)."""
RESTORE_TIMEOUT = 30


class IdleCrowd:
    """A stranger's idle connections to keepers: IDLE to each, each from a loopback address of its
    own, none ever completing a request; a connection a keeper shuts is opened again after
    REOPEN_AFTER seconds. `refresh()` opens them all afresh at once; `close()` closes them all."""

    def __init__(self, keepers: list[tuple[str, int]]) -> None:
        self._wanted = [(keeper, f"127.0.0.{2 + i}", i % 2 == 1) for keeper in keepers for i in range(IDLE)]
        self._open: dict[int, socket.socket] = {}  # index into _wanted -> its connection
        self._due = {index: 0.0 for index in range(len(self._wanted))}  # index -> when to (re)open it
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.shut_by_keepers = 0
        self._thread = threading.Thread(target=self._run, name="idle-crowd", daemon=True)

    def start(self) -> IdleCrowd:
        self.refresh()
        self._thread.start()
        return self

    def _connect(self, index: int) -> None:
        (host, port), source, partial = self._wanted[index]
        connection = socket.create_connection((host, port), timeout=10, source_address=(source, 0))
        if partial:  # a request line and a header, never the empty line that ends the headers
            connection.sendall(b"GET /part/local/x HTTP/1.1\r\nHost: keeper\r\n")
        self._open[index] = connection

    def refresh(self) -> None:
        """Close every connection and open all of them again, now (each keeper queues and admits them
        in order: they are the newest when the job's next connection arrives)."""
        with self._lock:
            for connection in self._open.values():
                connection.close()
            self._open.clear()
            for index in range(len(self._wanted)):
                self._connect(index)
                self._due.pop(index, None)

    def count(self) -> int:
        with self._lock:
            return len(self._open)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                by_socket = {connection: index for index, connection in self._open.items()}
            try:
                readable = select.select(list(by_socket), [], [], 0.1)[0] if by_socket else []
            except (OSError, ValueError):  # refresh() closed one meanwhile
                continue
            with self._lock:
                for connection in readable:  # an answer (a 503) or the end: the keeper is done with it
                    index = by_socket[connection]
                    if self._open.get(index) is connection:
                        connection.close()
                        del self._open[index]
                        self._due[index] = time.monotonic() + REOPEN_AFTER
                        self.shut_by_keepers += 1
                now = time.monotonic()
                for index in [i for i, due in self._due.items() if due <= now]:
                    with contextlib.suppress(OSError):
                        self._connect(index)
                        del self._due[index]
            if not by_socket:
                self._stop.wait(0.1)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        with self._lock:
            for connection in self._open.values():
                connection.close()
            self._open.clear()


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of the IPv4 TCP sockets process `pid` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
            hex_address, hex_port = fields[1].split(":")
            address = socket.inet_ntoa(bytes.fromhex(hex_address)[::-1])
            found.append((address, int(hex_port, 16)))
    return found


def test_idle_strangers_at_both_keepers_do_not_stop_a_restore_from_memory(tmp_path: Path, tiny_corpus: Path) -> None:
    crowd_held, held, go = tmp_path / "hold-for-crowd", tmp_path / "hold-after-step", go_files(tmp_path)
    faults = [f"after_step@{CROWD_AFTER}:do=hold:until={crowd_held}", f"after_step@{HOLD_AFTER}:do=hold:until={held}"]
    spec = job_spec(tmp_path, tiny_corpus, name="crowd", steps=STEPS, restore_timeout=RESTORE_TIMEOUT, faults=faults,
                    start_process=warm.popen)
    crowd: IdleCrowd | None = None
    with ChaosJob(spec) as job:
        try:
            job.start()
            wait_for(lambda: Path(f"{crowd_held}.held").exists(), 240, f"rank 0 to hold after step {CROWD_AFTER}")
            agents = job.agents
            memory = node_memory(job)
            # The keeper serves in its agent's process, on its --local-addr (c10d's store has the endpoint's port).
            store_port = int(job.endpoint.rsplit(":", 1)[1])
            keepers = [[(h, p) for h, p in listening(a.pid) if h == "127.0.0.1" and p != store_port] for a in agents]
            assert all(len(k) == 1 for k in keepers), f"not one keeper port per agent: {keepers}"
            crowd = IdleCrowd([k[0] for k in keepers]).start()
            crowd_held.touch()  # the job trains on through the crowd to step HOLD_AFTER
            wait_for(lambda: Path(f"{held}.held").exists(), 240, f"rank 0 to hold after step {HOLD_AFTER}")

            wait_settled(memory, HOLD_AFTER, f"step {HOLD_AFTER}'s replicas copied through {IDLE} idle connections per keeper")
            only_on_peers(memory)  # each rank's part now lies only in the other node's memory
            job.signal_worker(signal.SIGKILL, rank=0)
            wait_for(lambda: all(Path(f"{g}.held").exists() for g in go), 240, "the restarted group to be about to read")
            crowd.refresh()  # the keepers' newest connections when the group fetches
            for g in go:
                g.touch()

            restore = job.poll_for(lambda: restart_restore(job), 240, "the restarted group's restore")
            print(f"restored: {restore}; the stranger's connections open: {crowd.count()} of {2 * IDLE}")
            codes = job.wait(300)
            logs = job.logs(tail=20000)
        finally:
            if crowd is not None:
                print(f"the keepers shut {crowd.shut_by_keepers} of the stranger's connections")
                crowd.close()
    assert codes == [0, 0], f"exit codes {codes}\n{logs}"
    assert restore["source"] in ("memory", "peer"), f"{restore}\n{logs}"
    assert restore.get("bytes_fetched", 0) > 0, restore  # the parts came through the crowded keepers
    ends = [e["step"] for e in read_events(tmp_path / "events.jsonl") if e["event"] == "end"]
    assert ends and ends[-1] == STEPS, ends
