"""A stranger who can reach a keeper cannot deny it to the job (issue #40, items 2 and 7).

What was reproduced against a real keeper: 32 idle connections that never send
a byte took every slot and a correctly signed request got 503 (reconnecting
kept the denial going); a request signed for one keeper was accepted by another
keeper of the job; two uploads at once each passed the free-space check alone.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
from support import keeper_request, start_keeper
from test_keeper_auth import newest_part
from test_snapshots import keeper_key

from elastic._agent.launcher import keeper as keeper_module
from elastic._agent.launcher.keeper import SnapshotKeeper
from elastic._agent.launcher.keeper_endpoint import Conflict
from elastic._agent.launcher.keeper_slots import MAX_CONNECTIONS
from elastic._shared.storage import parts, peer_auth
from elastic._shared.storage.keeper_address import LOCAL

IDLE = 40
"""Connections a stranger holds open, more than the keeper's slots."""


def a_part(keeper: SnapshotKeeper) -> tuple[str, bytes]:
    """The path of a part file the keeper serves, and its bytes."""
    name = parts.part_stem(0, "1-abcdef", 0) + parts.DATA_SUFFIX
    (keeper.root / LOCAL / name).write_bytes(b"weights" * 100)
    return f"/part/{LOCAL}/{name}", b"weights" * 100


def test_idle_connections_of_strangers_never_deny_a_signed_request(keeper: SnapshotKeeper) -> None:
    path, data = a_part(keeper)
    host, port = keeper.url.removeprefix("http://").rsplit(":", 1)
    # From the job's own address, then from 40 addresses of their own (127.0.0.0/8 is all loopback).
    for sources in ([host] * IDLE, [f"127.0.0.{2 + i}" for i in range(IDLE)]):
        idle = [socket.create_connection((host, int(port)), timeout=30, source_address=(source, 0)) for source in sources]
        try:
            assert keeper_request(keeper.url, keeper_key(), "GET", path) == (200, data)
            proven, unproven = keeper._server.slots.counts()  # type: ignore[attr-defined]
            assert proven + unproven <= MAX_CONNECTIONS
        finally:
            for connection in idle:
                connection.close()


def test_a_request_signed_for_one_keeper_is_refused_by_another_of_the_job(tmp_path: Path, keeper: SnapshotKeeper, node_memory: Path) -> None:
    other = start_keeper(node_memory)  # the same job's secret, another agent's keeper
    try:
        path, data = a_part(keeper)
        a_part(other)
        key = keeper_key()
        for_keeper = key.sign("GET", path, receiver=peer_auth.receiver_of(keeper.url))
        assert keeper_request(other.url, key, "GET", path, headers=dict(for_keeper), sign=False)[0] == 403
        assert keeper_request(keeper.url, key, "GET", path, headers=dict(for_keeper), sign=False)[0] == 200
    finally:
        other.close(timeout=30)


class Body:
    """A part's data and tag as the endpoint's reader hands them over: after `go` is set, when held."""

    def __init__(self, data: bytes, tag: bytes, held: bool) -> None:
        self._rest = data + tag
        self.go = threading.Event()
        if not held:
            self.go.set()

    def read(self, n: int) -> bytes:
        assert self.go.wait(30)
        block, self._rest = self._rest[:n], self._rest[n:]
        return block

    def readinto(self, buffer: memoryview) -> int:
        block = self.read(len(buffer))
        buffer[: len(block)] = block
        return len(block)


def test_uploads_in_flight_together_cannot_fill_the_keepers_memory(
    tmp_path: Path, keeper: SnapshotKeeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    header, data, _ = newest_part(tmp_path, keeper)
    key, head, path = keeper_key(), header.to_json(), f"/replica/{header.stem}"
    real = keeper_module.shutil.disk_usage
    total = real(keeper.root).total
    # Room for one part and a half above the reserve: either upload alone fits, both together do not.
    monkeypatch.setattr(keeper_module.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=int(keeper_module.RESERVE_FRACTION * total) + 3 * len(data) // 2))

    # The other slot of the same writer: an upload in flight together with the first (one per slot at a time).
    other = parts.PartHeader(**{**header.__dict__, "slot": 1 - header.slot})
    other_head, other_path = other.to_json(), f"/replica/{other.stem}"

    def upload(held: bool, head: bytes = head, path: str = path) -> tuple[Body, peer_auth.Poly1305]:
        nonce = key.sign("PUT", path, receiver=peer_auth.receiver_of(keeper.url))[peer_auth.NONCE]
        mac = key.body_tag(nonce, peer_auth.put_what(path))
        mac.update(head + data)
        tag = key.body_tag(nonce, peer_auth.put_what(path))
        tag.update(head)  # as the endpoint does before handing the body over
        return Body(data, mac.finalize(), held), tag

    first, first_tag = upload(held=True)
    errors: list[BaseException] = []

    def receive_first() -> None:
        try:
            keeper.receive(header.stem, head, first, len(data), first_tag)
        except BaseException as exc:  # noqa: BLE001 - the main thread asserts on it
            errors.append(exc)

    thread = threading.Thread(target=receive_first)
    thread.start()
    try:
        while keeper._replicas.space.reserved == 0 and thread.is_alive():
            threading.Event().wait(0.01)  # the first upload has reserved its length and waits for its bytes
        twin, twin_tag = upload(held=False)
        with pytest.raises(Conflict, match="in flight"):  # the same slot again while its upload runs
            keeper.receive(header.stem, head, twin, len(data), twin_tag)
        second, second_tag = upload(held=False, head=other_head, path=other_path)
        with pytest.raises(OSError, match="too little room"):
            keeper.receive(other.stem, other_head, second, len(data), second_tag)
    finally:
        first.go.set()
        thread.join(30)
    assert errors == [] and keeper._replicas.space.reserved == 0
    third, third_tag = upload(held=False)  # the first is stored, its reservation released
    keeper.receive(header.stem, head, third, len(data), third_tag)
