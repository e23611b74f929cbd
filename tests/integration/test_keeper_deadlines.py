"""Every read has a deadline and every close ends: a FIFO in a keeper's stage is refused without
blocking, a keeper's close gives up in bounded time while a stuck thread holds its lock, and a peer
that trickles its answer is dropped at the fetch's overall deadline for the next keeper.
In-process keepers and a local trickling server (listening sockets: not the unit tier)."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest
from support import start_keeper

from elastic._agent.launcher import keeper as keeper_module
from elastic._agent.launcher import keeper_directory
from elastic._shared.storage.directory import CheckpointStore
from elastic._shared.storage.keeper_address import part_url
from elastic._worker.checkpoint import keeper_client, part_files
from elastic._worker.checkpoint.part_files import PartFetchError, PartFiles


def test_a_fifo_as_a_stage_header_is_refused_without_blocking(tmp_path: Path, node_memory: Path) -> None:
    keeper = start_keeper(node_memory)
    try:
        stage = tmp_path / "ckpt" / ".snapshot.step_00000003.run.w1.g0"
        stage.mkdir(parents=True)
        os.mkfifo(stage / "part_00000.json")  # a plain read would wait for a writer forever
        assert not keeper_directory.try_commit(CheckpointStore(tmp_path / "ckpt"), stage, 3, 1)
    finally:
        keeper.close(timeout=5)


def test_close_gives_up_in_bounded_time_while_a_stuck_thread_holds_the_lock(tmp_path: Path, monkeypatch, caplog, node_memory: Path) -> None:
    monkeypatch.setattr(keeper_module, "CLOSE_GRACE", 0.2)
    keeper = start_keeper(node_memory)
    stuck = threading.Event()
    keeper._lock.acquire()  # a persist stuck on a dead mount holds it
    try:
        outcome: list[bool] = []
        closing = threading.Thread(target=lambda: outcome.append(keeper.close(timeout=0.3)), daemon=True)
        closing.start()
        closing.join(60)  # a liveness bound, not a timing: unbounded, it would never return
        assert not closing.is_alive() and outcome == [False]
        assert "gave up cleaning up after 0.5 s" in caplog.text
        assert keeper.root.is_dir()  # never removed under a persist that may still read it
    finally:
        stuck.set()
        keeper._lock.release()


def _trickler(payload: bytes, every: float) -> tuple[socket.socket, str, threading.Event]:
    """A server that answers any request one byte every `every` seconds (a slow or stalled peer)."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                for byte in payload:
                    if done.wait(every):
                        return
                    try:
                        conn.sendall(bytes([byte]))
                    except OSError:
                        break

    threading.Thread(target=serve, daemon=True).start()
    return listener, f"http://127.0.0.1:{listener.getsockname()[1]}", done


def test_a_trickling_peer_is_dropped_at_the_overall_deadline_and_the_next_keeper_asked(tmp_path: Path, monkeypatch, node_memory: Path) -> None:
    # Well formed (a tag that fails at its very end): only a deadline over the whole answer stops it early.
    answer = b"HTTP/1.1 206 Partial Content\r\nContent-Length: 116\r\nContent-Range: bytes 0-99/4096\r\n\r\n" + b"x" * 116
    listener, slow_url, done = _trickler(answer, 0.05)  # every single read arrives well within any per-read timeout
    keeper = start_keeper(node_memory)
    waited: list[float] = []
    real = keeper_client.KeeperConnections.get_range

    def noting(self, url, key, start, stop, timeout):
        waited.append(timeout)
        return real(self, url, key, start, stop, timeout)

    monkeypatch.setattr(keeper_client.KeeperConnections, "get_range", noting)
    monkeypatch.setattr(part_files, "FETCH_TIMEOUT", 1.0)
    try:
        data = os.urandom(4096)
        name = "rank_00000.1-abc.s0.bin"
        (keeper.root / "local" / name).write_bytes(data)
        good_url = part_url(keeper.url, "local", name)
        from elastic._shared.storage.peer_auth import PeerKey

        key = PeerKey.from_file(keeper.secret_file)
        files = PartFiles(tmp_path / "restore", {"shard": [part_url(slow_url, "local", name), good_url]}, key=key)
        (tmp_path / "restore").mkdir()
        got = files.view("shard", 0, 100)
        assert got is not None and bytes(got) == data[:100]  # from the second keeper
        assert waited[0] <= 1.0  # what the code gave the slow peer in all, not per read
        assert files._failed == {part_url(slow_url, "local", name)}
        files.close()
        # The slow peer alone: a PartFetchError (the restore goes to disk), never a wait without end.
        alone = PartFiles(tmp_path / "restore", {"shard": [part_url(slow_url, "local", name)]}, key=key)
        with pytest.raises(PartFetchError, match="no complete answer within the request"):
            alone.view("shard", 0, 100)
        alone.close()
    finally:
        done.set()
        listener.close()
        keeper.close(timeout=5)
