"""The snapshot keeper answers only its job: signed requests, tagged bodies, this run's parts, bounded use.

What an operator tried: an unauthenticated GET of the weights, a forged replica
with `step=99999999` and the recipe's shapes (valid crc32c, since they travel in
the same header), a signed part of another run, a tampered body, a recorded
answer replayed, a flood of connections, a replica that would fill /dev/shm.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from support import keeper_request
from test_snapshots import Job, assert_same, keeper_job, keeper_key

from elastic._agent.launcher import keeper as keeper_module
from elastic._agent.launcher import keeper_directory, keeper_files
from elastic._agent.launcher.keeper import SnapshotKeeper
from elastic._agent.launcher.keeper_slots import MAX_CONNECTIONS
from elastic._shared.storage import claim, parts, peer_auth, secret_files
from elastic._shared.storage.chunks import block_checksums
from elastic._shared.storage.directory import CheckpointStore
from elastic._shared.storage.keeper_address import LOCAL, REPLICA
from elastic._shared.storage.parts import PartHeader
from elastic._shared.storage.peer_auth import PeerKey
from elastic._worker.checkpoint import keeper_client

STRANGER = PeerKey(b"not-the-jobs-secret-at-all-0123")


def newest_part(tmp_path: Path, keeper: SnapshotKeeper, steps: int = 2) -> tuple[PartHeader, bytes, dict]:
    """A job's newest snapshot part on this node (its header and data), the keeper told the job's
    generation, and the job's state at that step."""
    job = Job(tmp_path / "ckpt")
    job.run(steps)
    job.ckpt.flush()
    job.ckpt.memory.wait_previous()
    want = job.state()
    job.close()
    header = max(parts.read_headers(keeper.root / LOCAL), key=lambda h: h.step)
    data = (keeper.root / LOCAL / (header.stem + parts.DATA_SUFFIX)).read_bytes()[: header.data_bytes]
    keeper_job(keeper, header)
    return header, data, want


def forged(header: PartHeader, data: bytes, **changes: object) -> tuple[PartHeader, bytes]:
    """The part with every weight set to 7.0 and `changes` to its header, its crc32c recomputed:
    what anyone who can read one part can make."""
    raw = bytearray(data)
    chunks = []
    for chunk in header.chunks:
        offset, length = int(chunk["offset"]), int(chunk["length"])
        if chunk["dtype"] == "torch.float32":
            raw[offset : offset + length] = torch.full((length // 4,), 7.0).numpy().tobytes()
        checksums = block_checksums(memoryview(raw)[offset : offset + length], int(chunk["block"]))
        chunks.append({**chunk, "crc32c": list(checksums)})
    fields = {**json.loads(header.to_json()), "chunks": chunks, "writer": "1-abcdef", **changes}
    fake = PartHeader.from_json(json.dumps(fields))
    return fake, bytes(raw)


def answer_to_headers(keeper: SnapshotKeeper, path: str, headers: dict[str, str]) -> int:
    """The status a keeper answers a PUT of `headers` alone, its body never sent."""
    host, port = keeper.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        lines = [f"PUT {path} HTTP/1.1", f"Host: {host}", *(f"{k}: {v}" for k, v in headers.items())]
        raw.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        answer = raw.recv(200).decode()
    return int(answer.split()[1])


def test_unsigned_bad_stale_and_replayed_requests_are_refused_before_any_body(tmp_path: Path, keeper: SnapshotKeeper) -> None:
    header, data, _ = newest_part(tmp_path, keeper)
    path = f"/part/{LOCAL}/{header.stem}{parts.DATA_SUFFIX}"
    key = keeper_key()
    assert keeper_request(keeper.url, key, "GET", path) == (200, data)  # the job itself reads it
    assert keeper_request(keeper.url, key, "GET", path, sign=False)[0] == 401
    assert keeper_request(keeper.url, STRANGER, "GET", path)[0] == 403
    to = peer_auth.receiver_of(keeper.url)
    stale = key.sign("GET", path, receiver=to, now=0)
    assert keeper_request(keeper.url, key, "GET", path, headers=stale, sign=False)[0] == 403
    fresh = key.sign("GET", path, receiver=to)
    assert keeper_request(keeper.url, key, "GET", path, headers=dict(fresh), sign=False)[0] == 200
    assert keeper_request(keeper.url, key, "GET", path, headers=dict(fresh), sign=False)[0] == 403  # replayed
    # A PUT that announces a gigabyte and sends none of it is answered at once: no body is read.
    path = f"/replica/{header.stem}"
    announced = {"Content-Length": str(2**30), "X-Header-Bytes": "100"}
    assert answer_to_headers(keeper, path, announced) == 401
    assert answer_to_headers(keeper, path, {**announced, **STRANGER.sign("PUT", path, receiver=to, content_length=2**30, header_bytes=100)}) == 403
    assert not list((keeper.root / REPLICA).iterdir())


def test_a_forged_replica_is_refused_never_restored_and_never_persisted(tmp_path: Path, keeper: SnapshotKeeper) -> None:
    header, data, want = newest_part(tmp_path, keeper, steps=7)  # durable at 5, 6 and 7 in memory
    fake, fake_data = forged(header, data, step=99_999_999)
    head = fake.to_json()
    for key, status in ((None, 401), (STRANGER, 403)):
        got, _ = keeper_request(keeper.url, key or STRANGER, "PUT", f"/replica/{fake.stem}", head=head, data=fake_data,
                                sign=key is not None)
        assert got == status
    assert parts.read_headers(keeper.root / REPLICA) == []
    assert keeper.persist() == [header.step]  # the job's own newest step, not the forgery's
    assert CheckpointStore(tmp_path / "ckpt").committed()[0].step == header.step
    again = Job(tmp_path / "ckpt", seed=5)
    assert again.ckpt.restore() == header.step
    assert_same(want, again.state())
    again.close()


def test_signed_parts_of_another_run_generation_or_size_and_tampered_bodies_are_not_kept(
    tmp_path: Path, keeper: SnapshotKeeper
) -> None:
    header, data, _ = newest_part(tmp_path, keeper)
    key = keeper_key()
    generation = str(header.extra.get("generation", ""))
    for changes in ({"run_id": "another-run"}, {"extra": {"generation": "old-timeline"}}, {"world_size": 2, "rank": 1}):
        fake, fake_data = forged(header, data, **changes)
        status, _ = keeper_request(keeper.url, key, "PUT", f"/replica/{fake.stem}", head=fake.to_json(), data=fake_data)
        assert status == 409, changes
    # The job's own part, changed on the wire after it was tagged: its tag fails, nothing is kept.
    fake, _ = forged(header, data, extra={"generation": generation})
    path = f"/replica/{fake.stem}"
    head = fake.to_json()
    signed = key.sign("PUT", path, receiver=peer_auth.receiver_of(keeper.url),
                      content_length=len(head) + len(data) + peer_auth.TAG_BYTES, header_bytes=len(head))
    tag = key.body_tag(signed[peer_auth.NONCE], peer_auth.put_what(path))
    tag.update(head + data)
    tampered = bytearray(data)
    tampered[-1] ^= 1
    host, port = keeper.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("PUT", path, body=head + bytes(tampered) + tag.finalize(), headers={"X-Header-Bytes": str(len(head)), **signed})
    assert conn.getresponse().status == 400
    conn.close()
    # A header past 1 MiB is refused by its declared size, before any of it is read.
    length, head_bytes = 2**20 + 1 + len(data) + peer_auth.TAG_BYTES, 2**20 + 1
    huge = key.sign("PUT", path, receiver=peer_auth.receiver_of(keeper.url), content_length=length, header_bytes=head_bytes)
    assert answer_to_headers(keeper, path, {"Content-Length": str(length), "X-Header-Bytes": str(head_bytes), **huge}) == 400
    assert [p.name for p in (keeper.root / REPLICA).iterdir()] == []
    # The same part, untouched, is kept.
    assert keeper_request(keeper.url, key, "PUT", path, head=head, data=data)[0] == 204
    assert [h.stem for h in parts.read_headers(keeper.root / REPLICA)] == [fake.stem]


class _Replayer(BaseHTTPRequestHandler):
    """A man in the middle: answers every GET with an answer it recorded from the real keeper."""

    protocol_version = "HTTP/1.1"
    recorded: tuple[int, dict[str, str], bytes] = (0, {}, b"")

    def do_GET(self) -> None:
        status, headers, body = self.recorded
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_recorded_or_altered_answer_is_never_data(tmp_path: Path, keeper: SnapshotKeeper) -> None:
    header, data, _ = newest_part(tmp_path, keeper)
    key = keeper_key()
    url = f"{keeper.url}/part/{LOCAL}/{header.stem}{parts.DATA_SUFFIX}"
    assert keeper_client.get_range(url, key, 0, 64, 10) == data[:64]
    # Record one genuine answer, then serve it (as is, and with one byte changed) to new requests.
    path = url.split(keeper.url, 1)[1]
    host, port = keeper.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", path, headers={"Range": "bytes=0-63", **key.sign("GET", path, receiver=peer_auth.receiver_of(keeper.url))})
    response = conn.getresponse()
    body = response.read()
    headers = {k: v for k, v in response.getheaders() if k in ("Content-Range", "Content-Length")}
    conn.close()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Replayer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        fake_url = f"http://127.0.0.1:{server.server_address[1]}{path}"
        for answer in (body, bytes([body[0] ^ 1]) + body[1:]):
            _Replayer.recorded = (206, headers, answer)
            with pytest.raises(OSError, match="fails its tag"):
                keeper_client.get_range(fake_url, key, 0, 64, 10)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_connections_are_bounded_and_a_full_memory_refuses_replicas(
    tmp_path: Path, keeper: SnapshotKeeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    header, data, _ = newest_part(tmp_path, keeper)
    key = keeper_key()
    path = f"/part/{LOCAL}/{header.stem}{parts.DATA_SUFFIX}"
    host, port = keeper.url.removeprefix("http://").rsplit(":", 1)
    # Every slot held by the job's own kept connections (each carried a signed request): 503.
    kept = [http.client.HTTPConnection(host, int(port), timeout=10) for _ in range(MAX_CONNECTIONS)]
    try:
        for conn in kept:
            conn.request("GET", path, headers={"Range": "bytes=0-63", **key.sign("GET", path, receiver=f"{host}:{port}")})
            response = conn.getresponse()
            response.read()
            assert response.status == 206
        assert keeper._server.slots.counts() == (MAX_CONNECTIONS, 0)
        assert keeper_request(keeper.url, key, "GET", path)[0] == 503
    finally:
        for conn in kept:
            conn.close()
    served = False
    for _ in range(200):  # the idle connections' handlers see them closed and leave
        if keeper_request(keeper.url, key, "GET", path)[0] == 200:
            served = True
            break
        threading.Event().wait(0.05)
    assert served
    # A replica that would leave less than the reserve free in the keeper's memory: 507, nothing kept.
    real = keeper_module.shutil.disk_usage
    monkeypatch.setattr(keeper_module.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=len(data) + int(0.05 * real(p).total)))
    status, _ = keeper_request(keeper.url, key, "PUT", f"/replica/{header.stem}", head=header.to_json(), data=data)
    assert status == 507
    assert list((keeper.root / REPLICA).iterdir()) == []


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by itself (its own CA) and its key, as PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "keeper")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "keeper.crt", directory / "keeper.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_keepers_can_serve_over_tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, node_memory: Path) -> None:
    cert, key_file = self_signed(tmp_path)
    tls = peer_auth.server_tls({peer_auth.TLS_CERT_ENV: str(cert), peer_auth.TLS_KEY_ENV: str(key_file)})
    key = PeerKey(b"a secret for this test only, 32b")
    keeper = SnapshotKeeper("127.0.0.1", key=key, run_id="tls", base=node_memory, tls=tls)
    try:
        assert keeper.url.startswith("https://")
        name = parts.part_stem(0, "1-abcdef", 0) + parts.DATA_SUFFIX
        (keeper.root / LOCAL / name).write_bytes(b"weights" * 100)
        keeper_client.use_tls_of({peer_auth.TLS_CA_ENV: str(cert)})  # as the manager does, with ctx.env
        assert keeper_client.get_range(f"{keeper.url}/part/{LOCAL}/{name}", key, 0, 700, 10) == b"weights" * 100
        # Without the job's CA the keeper's certificate is not trusted; in clear text there is no answer.
        keeper_client.use_tls_of({})
        with pytest.raises(OSError, match="CERTIFICATE_VERIFY_FAILED"):
            keeper_client.get_range(f"{keeper.url}/part/{LOCAL}/{name}", key, 0, 700, 10)
        with pytest.raises((OSError, http.client.HTTPException)):
            keeper_client.get_range(f"{keeper.url.replace('https', 'http')}/part/{LOCAL}/{name}", key, 0, 700, 10)
    finally:
        monkeypatch.setattr(keeper_client, "_tls", None)
        keeper.close(timeout=10)
    with pytest.raises(peer_auth.SecretError, match="needs both"):
        peer_auth.server_tls({peer_auth.TLS_CERT_ENV: str(cert)})


def test_malformed_headers_in_memory_never_stop_the_keeper(tmp_path: Path, keeper: SnapshotKeeper) -> None:
    header, data, _ = newest_part(tmp_path, keeper, steps=7)
    bad = json.loads(header.to_json())
    for where, changes in ((LOCAL, {"step": []}), (REPLICA, {"rank": 5, "world_size": 2}), (LOCAL, {"chunks": "x"})):
        stem = parts.part_stem(header.rank, f"{os.getpid():x}-bad{len(changes)}{where[0]}", 0)
        (keeper.root / where / (stem + parts.DATA_SUFFIX)).write_bytes(data)
        (keeper.root / where / (stem + parts.HEADER_SUFFIX)).write_text(json.dumps({**bad, **changes}))
    keeper.prune()
    assert keeper.persist() == [header.step]  # the good part is persisted, the bad ones skipped
    maintenance = [t for t in keeper._threads if t.name == "snapshot-keeper"]
    keeper.workers_stopped()  # one more persist and prune on its own thread
    assert keeper.wait_idle(30) and all(t.is_alive() for t in maintenance)


def test_a_keeper_commits_stages_and_prunes_nothing_where_another_job_writes(tmp_path: Path, keeper: SnapshotKeeper) -> None:
    newest_part(tmp_path, keeper, steps=7)  # durable at 5; 6 and 7 in memory
    root = tmp_path / "ckpt"
    (root / f"{keeper_directory.STAGE_PREFIX}step_00000003.x").mkdir()  # a stage the other job may still use
    before = sorted(p.name for p in root.iterdir())
    claim.claim(root, claim.WriterIdentity.of_process("another-job", os.getpid()))
    assert keeper.persist() == []
    assert sorted(p.name for p in root.iterdir()) == before
    keeper.close(timeout=10)
    assert sorted(p.name for p in root.iterdir()) == before


def test_keepers_live_in_a_directory_only_their_user_can_open(tmp_path: Path) -> None:
    directory = keeper_files.private_directory(tmp_path)
    assert directory.name == f"torchrevive-snapshots-{os.geteuid()}" and (directory.stat().st_mode & 0o777) == 0o700
    os.chmod(directory, 0o755)  # someone opened it up: nothing of the job's goes there
    with pytest.raises(peer_auth.SecretError, match="only this user can open"):
        keeper_files.private_directory(tmp_path)
    os.chmod(directory, 0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link_base = tmp_path / "links"
    link_base.mkdir()
    (link_base / directory.name).symlink_to(elsewhere)  # a directory swapped for a link
    with pytest.raises(peer_auth.SecretError, match="not a directory of this user's"):
        keeper_files.private_directory(link_base)


def test_crafted_files_in_node_memory_never_stop_a_keeper_starting_pruning_or_closing(tmp_path: Path, node_memory: Path) -> None:
    base = keeper_files.private_directory(node_memory)
    for name, owner in (("huge-pid", {"host": socket.gethostname(), "pid": 2**40}), ("a-list", [1]),
                        ("not-json", None)):
        (base / name).mkdir()
        (base / name / keeper_files.OWNER_FILE).write_text("{" if owner is None else json.dumps(owner))
    (base / "a-fifo").mkdir()
    os.mkfifo(base / "a-fifo" / keeper_files.OWNER_FILE)  # reading it would wait for a writer forever
    stale = secret_files.host_secret_file(base, "a-run-killed-long-ago")
    os.utime(stale, (0, 0))
    fresh = secret_files.host_secret_file(base, "a-run-starting-now")  # its keeper's directory is not made yet
    keeper = SnapshotKeeper("127.0.0.1", key=STRANGER, run_id="r", base=node_memory)
    try:
        assert not stale.exists() and fresh.exists()
        assert not (base / "huge-pid").exists()  # no process has that pid: an orphan, removed
        huge = parts.part_stem(0, "ffffffffffffffff-abcdef", 0) + parts.DATA_SUFFIX  # a pid os.kill cannot take
        assert parts.parse_part_name(huge) is not None
        (keeper.root / LOCAL / huge).write_bytes(b"x")
        keeper.prune()
    finally:
        keeper.close(timeout=10)


def test_headers_that_trickle_in_are_cut_off(tmp_path: Path, keeper: SnapshotKeeper, monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic._agent.launcher import keeper_endpoint

    monkeypatch.setattr(keeper_endpoint, "HEADER_SECONDS", 2.0)
    host, port = keeper.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as raw:
        raw.sendall(b"GET /part/local/x HTTP/1.1\r\n")
        cut = False
        for _ in range(40):  # a header byte every 0.25 s: each read is quick, the whole is not
            try:
                raw.sendall(b"X")
                if raw.recv(1, socket.MSG_DONTWAIT) == b"":
                    cut = True
                    break
            except BlockingIOError:
                pass
            except OSError:
                cut = True
                break
            threading.Event().wait(0.25)
        assert cut, "a connection sending its headers byte by byte for 10 s was not cut off"


def test_a_peer_that_hangs_up_before_its_answer_leaves_no_traceback(
    tmp_path: Path, keeper: SnapshotKeeper, capfd: pytest.CaptureFixture[str]
) -> None:
    host, port = keeper.url.removeprefix("http://").rsplit(":", 1)
    for _ in range(20):  # some of these lose the race and hang up before the 401 is written
        with socket.create_connection((host, int(port)), timeout=10) as raw:
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST at close
            raw.sendall(b"GET /part/local/x HTTP/1.1\r\nHost: h\r\n\r\n")
    assert keeper_request(keeper.url, keeper_key(), "GET", "/part/local/x")[0] == 404  # still serving
    assert "Traceback" not in capfd.readouterr().err



def test_range_requests_to_one_keeper_share_a_kept_connection(tmp_path: Path, keeper: SnapshotKeeper) -> None:
    """Many ranges, one connection; one the keeper closed while idle is replaced at once."""
    header, data, _ = newest_part(tmp_path, keeper)
    key = keeper_key()
    url = f"{keeper.url}/part/{LOCAL}/{header.stem}{parts.DATA_SUFFIX}"
    connections = keeper_client.KeeperConnections()
    try:
        for start in range(0, 640, 64):
            assert connections.get_range(url, key, start, start + 64, 10) == data[start:start + 64]
        assert connections.opened == 1
        server = keeper._server
        deadline = time.monotonic() + 30
        while not server._deadlines and time.monotonic() < deadline:
            time.sleep(0.01)  # the handler waits for the next request's headers, with a deadline
        with server._deadline_lock:
            for raw in server._deadlines:
                server._deadlines[raw] = 0.0
        server.shut_late_connections()  # as the keeper does with an idle connection after HEADER_SECONDS
        assert connections.get_range(url, key, 64, 128, 10) == data[64:128]
        assert connections.opened == 2
    finally:
        connections.close()
