"""The memory tier in one process: snapshots into a keeper's shared memory, restore from
them before disk, torn and corrupt parts never loaded, the keeper's endpoint and its
persist at the breakpoint."""

from __future__ import annotations

import http.client
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rank_processes import run_ranks
from support import free_port, keeper_request
from torch.distributed.checkpoint.api import CheckpointException

from elastic._agent.launcher.keeper import SnapshotKeeper
from elastic._shared.common.errors import CorruptCheckpoint
from elastic._shared.storage import parts, peer_auth, sharded, tensors_json
from elastic._shared.storage.keeper_address import LOCAL, REPLICA, KeeperAddress
from elastic._shared.storage.peer_auth import PeerKey
from elastic._worker.checkpoint import (
    CheckpointManager,
    CheckpointStore,
    part_files,
    read_checkpoint,
)
from elastic._worker.checkpoint.memory import MemorySnapshots
from elastic._worker.checkpoint.part_files import PartFetchError, PartFiles
from elastic._worker.config import RunConfig
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.observe.events import EventLog, read_events
from elastic._worker.runtime.context import init_worker


class Job:
    """A tiny model with a buffer (batch norm), AdamW, a schedule and a sampler."""

    def __init__(
        self, ckpt_dir: Path, *, seed: int = 0, events: Path | None = None, snapshot_every: int = 1,
        environ: dict[str, str] | None = None,
    ) -> None:
        torch.manual_seed(seed)
        self.ctx = init_worker("cpu", environ=environ if environ is not None else dict(os.environ))  # (what a test set)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)
        self.sampler = ElasticSampler(64, batch_size=4, seed=3)
        self.events = EventLog(events, restart=0)
        self.ckpt = CheckpointManager(
            self.ctx, RunConfig(ckpt_dir=ckpt_dir, ckpt_every=5, seed=3, snapshot_every=snapshot_every),
            model=self.model, optimizer=self.optimizer, sampler=self.sampler, scheduler=self.scheduler,
            events=self.events,
        )

    def run(self, steps: int, start: int = 0) -> int:
        for step in range(start + 1, start + steps + 1):
            self.model(torch.randn(4, 4)).pow(2).mean().backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.scheduler.step()
            self.sampler.advance(1)
            self.ckpt.maybe_save(step)
        return start + steps

    def state(self) -> dict[str, torch.Tensor]:
        out = {f"model/{k}": v.clone() for k, v in self.model.state_dict().items()}
        for param_id, values in self.optimizer.state_dict()["state"].items():
            out.update({f"optim/{param_id}/{k}": v.clone() for k, v in values.items()})
        return out

    def close(self) -> None:
        self.ckpt.close()
        self.events.close()




def keeper_job(keeper: SnapshotKeeper, header: parts.PartHeader) -> None:
    """Tell `keeper` that its node's workers run `header`'s run, generation and world size (as a
    restore does), so that it keeps replicas of them."""
    keeper.address.note_job(header.run_id, str(header.extra.get("generation", "")), header.world_size)

def keeper_key() -> PeerKey:
    """The job's secret, as the `keeper` fixture put it in this process's environment."""
    key = PeerKey.from_env(os.environ)
    assert key is not None
    return key

def assert_same(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert want.keys() == got.keys()
    different = [k for k in want if not torch.equal(want[k], got[k])]
    assert not different, different


def test_restore_prefers_the_newer_snapshot_over_disk(tmp_path: Path, keeper: SnapshotKeeper) -> None:
    first = Job(tmp_path / "ckpt")
    first.run(7)  # durable checkpoint at step 5, snapshots up to 7
    first.ckpt.memory.wait_previous()
    want, rng = first.state(), torch.get_rng_state()
    first.close()
    second = Job(tmp_path / "ckpt", seed=1, events=tmp_path / "ev.jsonl")
    assert second.ckpt.restore() == 7
    assert_same(want, second.state())
    assert torch.equal(torch.get_rng_state(), rng)
    assert second.sampler.state_dict()["consumed"] == 7 * 4
    (restore,) = [e for e in read_events(tmp_path / "ev.jsonl") if e["event"] == "restore"]
    assert restore["source"] == "memory" and restore["step"] == 7 and restore["checkpoint"] == "step_00000007"
    assert restore["redone"] == 0  # step 7 was the last one finished, and its snapshot is whole
    second.close()


def test_a_torn_snapshot_is_never_loaded(tmp_path: Path, keeper: SnapshotKeeper) -> None:
    job = Job(tmp_path / "ckpt")
    job.run(6)
    job.ckpt.memory.wait_previous()
    steps = sorted(h.step for h in parts.read_headers(keeper.root / LOCAL))
    assert steps == [5, 6]  # two slots: the previous part stays whole while the next is written
    # A worker dies while rewriting the slot of step 5: its header is gone first.
    job.ckpt.memory.part_writer.slots.next(job.ckpt.state.layout.share(job.ckpt.state.layout.tensors(), 0, 1))
    assert sorted(h.step for h in parts.read_headers(keeper.root / LOCAL)) == [6]
    job.close()
    again = Job(tmp_path / "ckpt", seed=1)
    assert again.ckpt.restore() == 6
    again.close()


def test_a_corrupt_snapshot_falls_back_to_disk(tmp_path: Path, keeper: SnapshotKeeper, caplog) -> None:
    job = Job(tmp_path / "ckpt")
    job.run(5)  # step 5: on disk and in memory
    job.ckpt.flush()
    job.ckpt.memory.wait_previous()
    want = job.state()
    job.close()
    headers = [h for h in parts.read_headers(keeper.root / LOCAL) if h.step == 5]
    data = keeper.root / LOCAL / (headers[0].stem + parts.DATA_SUFFIX)
    raw = bytearray(data.read_bytes())
    raw[headers[0].chunks[0]["offset"]] ^= 0xFF  # a flipped bit in memory
    data.write_bytes(bytes(raw))
    again = Job(tmp_path / "ckpt", seed=1, events=tmp_path / "ev.jsonl")
    with caplog.at_level(logging.WARNING):
        assert again.ckpt.restore() == 5
    assert "cannot be restored" in caplog.text and "fails its crc32c check" in caplog.text
    assert_same(want, again.state())
    (restore,) = [e for e in read_events(tmp_path / "ev.jsonl") if e["event"] == "restore"]
    assert restore["source"] == "disk"
    again.close()


def test_a_snapshot_of_another_model_is_not_loaded(tmp_path: Path, keeper: SnapshotKeeper, caplog) -> None:
    job = Job(tmp_path / "ckpt")
    job.run(3)
    job.ckpt.memory.wait_previous()
    job.close()
    torch.manual_seed(0)
    ctx = init_worker("cpu", environ=dict(os.environ))
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters())
    other = CheckpointManager(ctx, RunConfig(ckpt_dir=tmp_path / "ckpt", ckpt_every=0, snapshot_every=1), model=model,
                              optimizer=optimizer, sampler=ElasticSampler(64, batch_size=4, seed=3))
    with caplog.at_level(logging.WARNING):
        assert other.restore() == 0  # nothing on disk yet, and the snapshot is another model's
    assert "another model" in caplog.text
    other.close()


def test_no_keeper_means_disk_only_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    for key in KeeperAddress(Path("/"), "", "").environ():
        monkeypatch.delenv(key, raising=False)
    with caplog.at_level(logging.INFO):
        job = Job(tmp_path / "ckpt")
    assert job.ckpt.memory is None
    assert "no snapshot keeper runs on this node" in caplog.text
    job.close()


def test_keeper_persists_the_newest_complete_snapshot(tmp_path: Path, keeper: SnapshotKeeper) -> None:
    job = Job(tmp_path / "ckpt")
    job.run(8)  # durable at step 5; snapshots of 7 and 8 in memory
    job.ckpt.flush()
    job.ckpt.memory.wait_previous()
    want = job.state()
    job.close()
    assert keeper.persist() == [8]
    store = CheckpointStore(tmp_path / "ckpt")
    newest = store.committed()[0]
    manifest = store.verify(newest)
    assert (newest.name, manifest.reason) == ("step_00000008", "breakpoint")
    _, tensors, trainer = read_checkpoint(newest.path)
    assert trainer["step"] == 8 and trainer["sampler"]["consumed"] == 32
    assert torch.equal(tensors["model/0.weight"], want["model/0.weight"])
    assert keeper.persist() == []  # nothing newer than what is committed
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".")]
    # A run without memory (a whole-job crash) resumes from it, bit-identical.
    os.environ.pop("TORCHREVIVE_SNAPSHOT_ROOT")
    fresh = Job(tmp_path / "ckpt", seed=2, snapshot_every=0)
    assert fresh.ckpt.restore() == 8
    assert_same(want, fresh.state())
    fresh.close()


def test_keeper_endpoint_takes_replicas_and_serves_parts(tmp_path: Path, keeper: SnapshotKeeper) -> None:
    job = Job(tmp_path / "ckpt")
    job.run(2)
    job.ckpt.memory.wait_previous()
    job.close()
    header = max(parts.read_headers(keeper.root / LOCAL), key=lambda h: h.step)
    data = (keeper.root / LOCAL / (header.stem + parts.DATA_SUFFIX)).read_bytes()[: header.data_bytes]
    key = keeper_key()
    keeper_job(keeper, header)

    def request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        head_bytes = int((headers or {}).pop("X-Header-Bytes", "0"))
        return keeper_request(keeper.url, key, method, path, head=body[:head_bytes], data=body[head_bytes:],
                              headers={"X-Header-Bytes": str(head_bytes), **(headers or {})} if method == "PUT" else headers)

    head = header.to_json()
    status, _ = request("PUT", f"/replica/{header.stem}", head + data, {"X-Header-Bytes": str(len(head))})
    assert status == 204
    (replica,) = parts.read_headers(keeper.root / REPLICA)
    assert (replica.step, replica.rank) == (header.step, header.rank)
    assert parts.read_data(keeper.root / REPLICA / (replica.stem + parts.DATA_SUFFIX), replica) == data
    status, served = request("GET", f"/part/{REPLICA}/{header.stem}{parts.DATA_SUFFIX}")
    assert (status, served) == (200, data)
    # A range: what a restoring rank on another node asks for (only the rows it reads).
    path = f"/part/{REPLICA}/{header.stem}{parts.DATA_SUFFIX}"
    assert request("GET", path, headers={"Range": "bytes=10-99"}) == (206, data[10:100])
    assert request("GET", path, headers={"Range": f"bytes=5-{len(data) + 50}"}) == (206, data[5:])
    for bad in (f"bytes={len(data)}-{len(data) + 9}", "bytes=9-2", "bytes=-5", "items=0-1"):
        assert request("GET", path, headers={"Range": bad})[0] == 416, bad
    # Only part files by name: no paths, no other files, no lying headers.
    assert request("GET", "/part/local/../owner.json")[0] == 404
    assert request("GET", f"/part/{LOCAL}/owner.json")[0] == 404
    assert request("PUT", f"/replica/{header.stem}", head + data[:-1], {"X-Header-Bytes": str(len(head))})[0] == 400
    assert request("PUT", "/replica/evil", head + data, {"X-Header-Bytes": str(len(head))})[0] == 400


def test_a_replica_slot_is_rewritten_in_place_and_a_bad_body_leaves_only_its_other_slot(
    tmp_path: Path, keeper: SnapshotKeeper
) -> None:
    """A peer's parts land in one file per slot, made once: a rewrite keeps the file (no new pages per
    step), and a body whose tag fails leaves that slot without a header, the writer's other slot whole."""
    job = Job(tmp_path / "ckpt")
    job.run(3)
    job.ckpt.memory.wait_previous()
    job.close()
    older, newer = sorted(parts.read_headers(keeper.root / LOCAL), key=lambda h: h.step)
    keeper_job(keeper, newer)
    key = keeper_key()

    def data_of(header: parts.PartHeader) -> bytes:
        return (keeper.root / LOCAL / (header.stem + parts.DATA_SUFFIX)).read_bytes()[: header.data_bytes]

    def put(header: parts.PartHeader, data: bytes) -> int:
        return keeper_request(keeper.url, key, "PUT", f"/replica/{header.stem}", head=header.to_json(), data=data)[0]

    assert put(older, data_of(older)) == put(newer, data_of(newer)) == 204
    replica = keeper.root / REPLICA
    files = {p.name: p.stat().st_ino for p in replica.iterdir() if p.suffix == parts.DATA_SUFFIX}
    assert len(files) == 2 and keeper._replicas.files_made == 2
    assert put(older, data_of(older)) == 204  # the same slot again: rewritten where it is
    assert {p.name: p.stat().st_ino for p in replica.iterdir() if p.suffix == parts.DATA_SUFFIX} == files
    assert keeper._replicas.files_made == 2
    tampered = bytearray(data_of(older))
    tampered[len(tampered) // 2] ^= 1
    path, head = f"/replica/{older.stem}", older.to_json()
    signed = key.sign("PUT", path, receiver=peer_auth.receiver_of(keeper.url),
                      content_length=len(head) + len(tampered) + peer_auth.TAG_BYTES, header_bytes=len(head))
    tag = key.body_tag(signed[peer_auth.NONCE], peer_auth.put_what(path))
    tag.update(head + data_of(older))  # the tag of the bytes the writer meant; one flipped on the way
    host, port = keeper.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("PUT", path, body=head + bytes(tampered) + tag.finalize(), headers={"X-Header-Bytes": str(len(head)), **signed})
    assert conn.getresponse().status == 400
    conn.close()
    (kept,) = parts.read_headers(replica)
    assert kept.stem == newer.stem and parts.read_data(replica / (kept.stem + parts.DATA_SUFFIX), kept) == data_of(newer)


def test_part_data_checks(tmp_path: Path, keeper: SnapshotKeeper) -> None:
    job = Job(tmp_path / "ckpt")
    job.run(1)
    job.ckpt.memory.wait_previous()
    job.close()
    (header,) = parts.read_headers(keeper.root / LOCAL)
    path = keeper.root / LOCAL / (header.stem + parts.DATA_SUFFIX)
    parts.read_data(path, header)
    bad = parts.PartHeader(**{**header.__dict__, "trainer_crc32c": header.trainer_crc32c ^ 1})
    with pytest.raises(CorruptCheckpoint, match="trainer state"):
        parts.decode_trainer(bad)
    with pytest.raises(CorruptCheckpoint, match="format"):
        parts.PartHeader.from_json(b'{"format": 99}')
    os.truncate(path, header.data_bytes - 1)
    assert parts.read_headers(keeper.root / LOCAL) == []  # a short data file is not a part


def test_prune_removes_a_dead_writers_parts_once_newer_ones_exist(tmp_path: Path, keeper: SnapshotKeeper) -> None:
    job = Job(tmp_path / "ckpt")
    job.run(2)  # the live writer (this process) holds steps 1 and 2
    job.ckpt.memory.wait_previous()
    local = keeper.root / LOCAL
    dead_writer = "7ffffffe-abcdef"  # no such pid: a worker that died

    def dead_parts(step: int, generation: str) -> None:
        for header in parts.read_headers(local):
            if header.writer == dead_writer:
                continue
            dead = parts.PartHeader(**{**header.__dict__, "writer": dead_writer, "step": step,
                                       "extra": {"generation": generation}})
            (local / (dead.stem + parts.DATA_SUFFIX)).write_bytes((local / (header.stem + parts.DATA_SUFFIX)).read_bytes())
            parts.write_header(local, dead)

    live_generation = str(parts.read_headers(local)[0].extra.get("generation", ""))
    dead_parts(50, "before")  # newer than anything the live writer has: a restore may still need them
    keeper.prune()
    assert {h.step for h in parts.read_headers(local) if h.writer == dead_writer} == {50}
    # A peer rank that died in the live writer's own generation, before its agent stopped the rest:
    # the persist about to come needs its part, however far the live one got.
    dead_parts(1, live_generation)
    keeper.prune()
    assert {h.step for h in parts.read_headers(local) if h.writer == dead_writer} == {1}
    dead_parts(1, "before")  # a writer of an earlier generation the live writer has moved past
    keeper.prune()
    assert not [p.name for p in local.iterdir() if dead_writer in p.name]
    assert {h.step for h in parts.read_headers(local)} == {1, 2}  # the live writer's own stay
    job.close()


def newest_part(tmp_path: Path, keeper: SnapshotKeeper, *, steps: int) -> tuple[Any, Any, Any, str, str]:
    """After `steps` steps of a Job: the newest part's header, its metadata and tensor shapes,
    the keeper's URL for its data, and the same URL on a port nothing listens on."""
    job = Job(tmp_path / "ckpt")
    job.run(steps)
    job.ckpt.memory.wait_previous()
    job.close()
    header = max(parts.read_headers(keeper.root / LOCAL), key=lambda h: h.step)
    metadata = parts.merged_metadata([header])
    name = f"part/{LOCAL}/{header.stem}{parts.DATA_SUFFIX}"
    return header, metadata, tensors_json.tensor_shapes(metadata), f"{keeper.url}/{name}", f"http://127.0.0.1:{free_port()}/{name}"


def test_part_files_fetch_only_the_spans_a_rank_reads_from_the_keepers_that_answer(
    tmp_path: Path, keeper: SnapshotKeeper
) -> None:
    header, metadata, shapes, url, dead = newest_part(tmp_path, keeper, steps=3)
    empty = tmp_path / "restore"
    empty.mkdir()
    # This node holds nothing: every byte comes from the keeper, after a dead one was tried.
    files = PartFiles(empty, {sharded.shard_file(0): [dead, url]}, key=keeper_key())
    targets = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in shapes.items()}
    read = sharded.load_tensors(targets, empty, metadata, group=None, source=files)
    here = tmp_path / "here"  # the same part read from this node's memory, as a restore on its node would
    here.mkdir()
    os.symlink(keeper.root / LOCAL / (header.stem + parts.DATA_SUFFIX), here / sharded.shard_file(0))
    local = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in shapes.items()}
    sharded.load_tensors(local, here, metadata, group=None, source=PartFiles(here, {}, key=None))  # its links followed
    assert all(torch.equal(targets[k], local[k]) for k in shapes)
    # Nearby chunks come in one request, with the alignment padding between them.
    assert read <= files.bytes_fetched <= header.data_bytes
    # One tensor of the part: only its bytes travel, not the whole part.
    key = max(shapes, key=lambda k: shapes[k][0].numel())
    files = PartFiles(empty, {sharded.shard_file(0): [url]}, key=keeper_key())
    one = {key: torch.empty(shapes[key][0], dtype=shapes[key][1])}
    assert sharded.load_tensors(one, empty, metadata, group=None, source=files) == files.bytes_fetched
    assert files.bytes_fetched == one[key].numel() * one[key].element_size() < header.data_bytes
    assert torch.equal(one[key], local[key])
    # No keeper answers: an OSError naming the part (the restore falls back to disk).
    with pytest.raises(CheckpointException) as caught:
        sharded.load_tensors(one, empty, metadata, group=None, source=PartFiles(empty, {sharded.shard_file(0): [dead]}, key=keeper_key()))
    error = sharded.first_error(caught.value)
    assert isinstance(error, OSError) and "no keeper could send" in str(error), repr(caught.value)


def _rank_on_node(rank: int, world: int, store: str, tmp: Path, keepers: list[dict[str, str]], phase: str, port: int) -> None:
    """Rank `rank` of a 3-node job whose node is `keepers[...]`: "save" runs on node `rank`,
    "restore" on node `rank - 1`, which holds neither its part nor that part's replica."""
    torch.set_num_threads(1)
    node = rank if phase == "save" else (rank - 1) % world
    os.environ.update(keepers[node])
    environ = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "TORCHELASTIC_RUN_ID": "three-nodes", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    os.environ.update(environ)
    job = Job(tmp / "ckpt", seed=0 if phase == "save" else 5, events=tmp / f"{phase}.{rank}.jsonl",
              environ={**keepers[node], **environ})
    if phase == "save":
        job.run(3)
        job.ckpt.memory.wait_previous()  # written here and copied to the next node
        torch.save(job.state(), tmp / f"want.{rank}.pt")
    else:
        assert job.ckpt.restore() == 3
        torch.save({"state": job.state(), "fetched": job.ckpt.fetched_bytes}, tmp / f"got.{rank}.pt")
    job.close()
    dist.destroy_process_group()


def test_a_rank_on_another_node_reads_its_part_from_the_keeper_that_holds_it(tmp_path: Path, node_memory: Path) -> None:
    # In node memory: the parts on a rank's own node are then read through maps.
    shm = node_memory
    secret = shm / "secret"
    secret.touch(mode=0o600)
    secret.write_text(os.urandom(32).hex())
    keepers = [SnapshotKeeper("127.0.0.1", key=PeerKey.from_file(secret), run_id="three-nodes", base=shm / f"node{n}", secret_file=secret)
               for n in range(3)]
    try:
        envs = [k.address.environ() for k in keepers]
        for phase in ("save", "restore"):
            run_ranks(_rank_on_node, 3, 3, "", tmp_path, envs, phase, free_port(), what=phase)
    finally:
        for k in keepers:
            k.close(timeout=30)
    want = torch.load(tmp_path / "want.0.pt")
    got: list[dict[str, Any]] = [torch.load(tmp_path / f"got.{rank}.pt") for rank in range(3)]
    for result in got:
        assert_same(want, result["state"])
    restore = [e for e in read_events(tmp_path / "restore.0.jsonl") if e["event"] == "restore"][-1]
    # Every part is in its own node's memory ("memory"); each rank's own share came over HTTP.
    assert restore["source"] == "memory"
    assert 0 < restore["bytes_fetched"] == sum(r["fetched"] for r in got)


def test_a_keeper_that_failed_is_asked_last_and_a_spent_deadline_stops_fetching(
    tmp_path: Path, keeper: SnapshotKeeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    header, metadata, shapes, url, dead = newest_part(tmp_path, keeper, steps=2)
    asked: list[str] = []
    get_range = part_files.KeeperConnections.get_range
    monkeypatch.setattr(part_files.KeeperConnections, "get_range",
                        lambda self, u, *a: (asked.append(u), get_range(self, u, *a))[1])
    monkeypatch.setattr(part_files, "READ_GAP", -1)  # one request per chunk: several requests
    empty = tmp_path / "restore"
    empty.mkdir()
    files = PartFiles(empty, {sharded.shard_file(0): [dead, url]}, key=keeper_key())
    targets = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in shapes.items()}
    sharded.load_tensors(targets, empty, metadata, group=None, source=files)
    assert len(asked) == len(shapes) + 1 and asked.count(dead) == 1, asked
    late = PartFiles(empty, {sharded.shard_file(0): [url]}, key=keeper_key(), deadline=time.monotonic() - 1)
    with pytest.raises(PartFetchError, match="time for fetching parts is spent"):
        late.view(sharded.shard_file(0), 0, 8)


def test_parts_no_keeper_sends_fall_back_to_disk(
    tmp_path: Path, keeper: SnapshotKeeper, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    job = Job(tmp_path / "ckpt")
    job.run(7)  # step 5 on disk, 7 in memory
    job.ckpt.flush()
    job.ckpt.memory.wait_previous()
    job.close()
    gather = MemorySnapshots.gather_files

    def only_on_a_dead_node(self, locations, tag, **kwargs):
        files = gather(self, locations, tag, **kwargs)
        dead = f"http://127.0.0.1:{free_port()}/part/{LOCAL}/gone.bin"
        return PartFiles(files.directory, {p.name: [dead] for p in files.directory.iterdir()}, key=keeper_key(), deadline=files.deadline)

    monkeypatch.setattr(MemorySnapshots, "gather_files", only_on_a_dead_node)
    again = Job(tmp_path / "ckpt", seed=1, events=tmp_path / "ev.jsonl")
    with caplog.at_level(logging.WARNING):
        assert again.ckpt.restore() == 5
    assert "cannot be restored" in caplog.text and "no keeper could send" in caplog.text
    (restore,) = [e for e in read_events(tmp_path / "ev.jsonl") if e["event"] == "restore"]
    assert restore["source"] == "disk" and "bytes_fetched" not in restore
    again.close()
