"""Checkpoints in a bucket (elastic/_shared/storage/object_store): the commit protocol, listing,
retention, the claim, torn uploads and bad input, against an in-memory store that enforces
conditional writes as S3 does (tests/memory_objects.py). The same code against a real S3 server:
tests/integration/test_object_store.py."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

import pytest
import torch
from memory_objects import MemoryObjects
from store_helpers import claim_of, manifest_for

from elastic._shared.common.errors import CheckpointStorageError, CorruptCheckpoint, UsageError
from elastic._shared.storage import chunks, location, sharded
from elastic._shared.storage.claim import WriterIdentity
from elastic._shared.storage.commit import commit_checkpoint
from elastic._shared.storage.durable import SaveFailed
from elastic._shared.storage.manifest import MANIFEST, Candidate
from elastic._shared.storage.object_store.bucket import BucketStore
from elastic._shared.storage.object_store.objects import ConditionFailed, StoreUnavailable
from elastic._shared.storage.object_store.transfer import BucketChunks, PartUpload
from elastic._worker.config import RunConfig, add_runtime_arguments
from torch.distributed.checkpoint.api import CheckpointException

PREFIX = "runs/a"


def bucket(keep: int = 3, objects: MemoryObjects | None = None) -> BucketStore:
    return BucketStore(location.parse_bucket(f"s3://bucket1/{PREFIX}"), objects or MemoryObjects(), keep=keep)


def save(store: BucketStore, step: int, *, owner: WriterIdentity | None, fill: float | None = None, tag: str = "t1",
         run_id: str = "run-a", **kwargs) -> str:
    """A format-2 checkpoint of one rank, uploaded and committed as the saver does it."""
    stage = store.begin(step, tag)
    value = float(step) if fill is None else fill
    writer = sharded.save_tensors({"model/w": torch.full((64, 32), value), "model/n": torch.tensor(step)}, stage,
                                  group=None, sink=store.part_sink(stage))
    return commit_checkpoint(
        store, stage, step=step, world_size=1, shard_sizes=writer.file_sizes,
        tensors_json=writer.tensors_json.encode(), trainer={"sampler": {"epoch": 0, "consumed": step}, "v": value},
        reason="periodic", run_id=run_id, owner=owner, **kwargs,
    )


def weights(store: BucketStore, step: int) -> torch.Tensor:
    (candidate,) = [c for c in store.committed() if c.step == step]
    manifest = store.verify(candidate)
    metadata = store.tensor_metadata(candidate, manifest)
    target = {"model/w": torch.empty(64, 32)}
    sharded.load_tensors(target, candidate.path, metadata, group=None, source=store.chunk_source(candidate.path))
    return target["model/w"]


def steps(store: BucketStore) -> list[int]:
    return [c.step for c in store.committed()]


def keys(objects: MemoryObjects, under: str = "") -> list[str]:
    return sorted(k[len(PREFIX) + 1:] for k in objects.objects if k.startswith(f"{PREFIX}/{under}"))


# -- what --ckpt-dir takes -------------------------------------------------------------------


@pytest.mark.parametrize("text", ["gs://bucket1/run", "ftp://host/dir", "S3x://b/c", "file:///tmp/x"])
def test_an_unsupported_scheme_is_refused_in_one_line_never_taken_for_a_path(text: str, capsys) -> None:
    with pytest.raises(UsageError, match="is not supported; use a directory or s3://BUCKET/PREFIX") as raised:
        RunConfig(ckpt_dir=text)
    assert "\n" not in str(raised.value)
    parser = argparse.ArgumentParser()
    add_runtime_arguments(parser)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--ckpt-dir", text])
    assert exited.value.code == 2
    assert "is not supported" in capsys.readouterr().err


@pytest.mark.parametrize("text, why", [
    ("s3://x", "is not a bucket name"),  # before: a local folder named `s3:`
    ("s3://Bucket/run", "is not a bucket name"),
    ("s3://bucket1/a/../b", "is not a plain key segment"),
    ("s3://bucket1/a//b", "is not a plain key segment"),
])
def test_a_malformed_bucket_url_is_one_line(text: str, why: str) -> None:
    with pytest.raises(UsageError, match=why):
        RunConfig(ckpt_dir=text)


def test_paths_and_bucket_urls_are_told_apart() -> None:
    assert RunConfig(ckpt_dir="runs/s3-like:name").ckpt_dir == "runs/s3-like:name"
    where = location.parse_bucket("s3://my-bucket.1/team/run-7/")
    assert (where.bucket, where.prefix, str(where)) == ("my-bucket.1", "team/run-7", "s3://my-bucket.1/team/run-7")
    assert where.key("step_00000001", MANIFEST) == "team/run-7/step_00000001/manifest.json"
    assert location.parse_bucket("s3://my-bucket").key("latest") == "latest"


# -- the commit ------------------------------------------------------------------------------


def test_a_save_round_trips_and_its_commit_is_one_create_only_manifest() -> None:
    objects = MemoryObjects()
    store = bucket(objects=objects)
    owner = WriterIdentity.new("run-a")
    store.prepare(owner)
    committed = save(store, 100, owner=owner, fill=1.5)
    assert committed == f"s3://bucket1/{PREFIX}/step_00000100"
    assert keys(objects, "step_") == [
        "step_00000100/manifest.json", "step_00000100/t1/shard_00000.bin", "step_00000100/t1/tensors.json",
        "step_00000100/t1/trainer.pt",
    ]
    assert torch.equal(weights(store, 100), torch.full((64, 32), 1.5))
    manifest = json.loads(objects.objects[f"{PREFIX}/step_00000100/manifest.json"][0])
    assert manifest["parts"] == "t1" and set(manifest["files"]) == {"shard_00000.bin", "tensors.json", "trainer.pt"}
    assert store.latest_pointer() == "step_00000100"
    # The manifest was written once, create-only, after every file: the last request of the commit.
    puts = [k for op, k in objects.requests if op in ("put", "complete_upload") and "step_00000100" in k]
    assert puts[-1].endswith("step_00000100/manifest.json")


def test_a_save_killed_before_its_manifest_is_never_a_checkpoint_and_its_upload_is_cleaned_later() -> None:
    objects = MemoryObjects()
    store = bucket(objects=objects)
    owner = WriterIdentity.new("run-a")
    store.prepare(owner)
    save(store, 100, owner=owner)

    def killed() -> None:
        raise KeyboardInterrupt  # the process dies between the last part and the manifest

    with pytest.raises(KeyboardInterrupt):
        save(store, 200, owner=owner, tag="t2", before_commit=killed)
    assert steps(store) == [100], "every part is there, but no manifest: not a checkpoint"
    assert keys(objects, "step_00000200") == ["step_00000200/t2/shard_00000.bin", "step_00000200/t2/tensors.json",
                                              "step_00000200/t2/trainer.pt"]
    assert store.latest_pointer() == "step_00000100"
    # The next job to claim the prefix removes the orphaned upload; the committed checkpoint stays whole.
    again = bucket(objects=objects)
    again.prepare(WriterIdentity.new("run-a"))
    assert keys(objects, "step_00000200") == []
    assert torch.equal(weights(again, 100), torch.full((64, 32), 100.0))


def test_a_failed_part_fails_the_save_removes_its_upload_and_leaves_the_last_checkpoint() -> None:
    objects = MemoryObjects()
    store = bucket(objects=objects)
    owner = WriterIdentity.new("run-a")
    store.prepare(owner)
    save(store, 100, owner=owner)
    objects.fail = lambda op, key: op == "put" and key.endswith("trainer.pt")
    with pytest.raises(SaveFailed, match=r"cannot write step_00000200 to s3://bucket1/runs/a: .*HTTP 500"):
        save(store, 200, owner=owner, tag="t2")
    assert steps(store) == [100] and keys(objects, "step_00000200") == []


def test_two_writers_of_one_step_commit_once_and_the_loser_discards_its_copy() -> None:
    objects = MemoryObjects()
    store = bucket(objects=objects)
    owner = WriterIdentity.new("run-a")
    store.prepare(owner)
    keeper = bucket(objects=objects)  # a keeper persisting the same step, without an owner
    save(keeper, 100, owner=None, tag="keeper1", fill=7.0)
    save(store, 100, owner=owner, tag="t1", fill=7.0)  # its create finds the keeper's commit, which checks
    assert steps(store) == [100]
    assert keys(objects, "step_00000100") == [
        "step_00000100/keeper1/shard_00000.bin", "step_00000100/keeper1/tensors.json",
        "step_00000100/keeper1/trainer.pt", "step_00000100/manifest.json",
    ]
    assert torch.equal(weights(store, 100), torch.full((64, 32), 7.0))


def test_a_commit_finding_a_broken_manifest_moves_it_aside_and_commits() -> None:
    objects = MemoryObjects()
    store = bucket(objects=objects)
    owner = WriterIdentity.new("run-a")
    store.prepare(owner)
    broken = manifest_for(100, {"shard_00000.bin": {"bytes": 10}})
    objects.put(f"{PREFIX}/step_00000100/{MANIFEST}", replace(broken, parts="gone").to_json().encode())
    save(store, 100, owner=owner, fill=3.0)
    assert torch.equal(weights(store, 100), torch.full((64, 32), 3.0))
    assert len(keys(objects, "corrupt/")) == 1


def test_a_writer_that_lost_the_claim_commits_nothing() -> None:
    objects = MemoryObjects()
    store = bucket(objects=objects)
    owner = WriterIdentity.new("run-a")
    store.prepare(owner)
    save(store, 100, owner=owner)
    newer = replace(WriterIdentity.new("run-a"), writer="newrank0")  # the same job's restarted rank 0
    bucket(objects=objects).claim(newer)
    with pytest.raises(SaveFailed, match="is now written by another writer"):
        save(store, 200, owner=owner, tag="t2")
    assert steps(store) == [100] and keys(objects, "step_00000200") == []


# -- the claim -------------------------------------------------------------------------------


def test_another_live_job_is_refused_and_a_stale_one_taken_over() -> None:
    objects = MemoryObjects()
    first = claim_of("run-a", pid=os.getppid())  # a live process of another job
    objects.put(f"{PREFIX}/writer.json", first.to_json().encode())
    other = WriterIdentity.new("run-b")
    with pytest.raises(CheckpointStorageError, match="is written by another job .*run run-a"):
        bucket(objects=objects).prepare(other)
    # Seen from another host, the claim is judged by its heartbeat.
    gone = replace(first, host="elsewhere", boot_id="", heartbeat=first.heartbeat - 10 * first.stale_after)
    objects.put(f"{PREFIX}/writer.json", gone.to_json().encode())
    bucket(objects=objects).prepare(other)
    assert bucket(objects=objects).writer().run_id == "run-b"


def test_a_claim_is_replaced_only_by_a_conditional_write() -> None:
    objects = MemoryObjects()
    store = bucket(objects=objects)
    mine = WriterIdentity.new("run-a")
    store.claim(mine)
    racer = replace(WriterIdentity.new("run-b"), host="elsewhere", boot_id="")
    raced = []

    def another_writer_claims_first(op: str, key: str) -> None:
        if op == "put" and key.endswith("writer.json") and not raced:
            raced.append(key)  # between our read and our write
            objects.objects[key] = (racer.to_json().encode(), '"theirs"', 0.0)

    objects.before = another_writer_claims_first
    with pytest.raises(SaveFailed, match="claimed by another writer"):
        store.heartbeat(mine)
    assert store.writer().run_id == "run-b", "the racer's claim was not overwritten"
    with pytest.raises(ConditionFailed):
        objects.put(f"{PREFIX}/writer.json", b"{}", create_only=True)


def test_an_unreadable_claim_counts_as_none() -> None:
    objects = MemoryObjects()
    objects.put(f"{PREFIX}/writer.json", b"x" * 100_000)
    store = bucket(objects=objects)
    store.prepare(WriterIdentity.new("run-a"))
    assert store.writer().run_id == "run-a"


# -- retention -------------------------------------------------------------------------------


def test_retention_keeps_the_newest_of_this_run_that_check_and_never_touches_another_run() -> None:
    objects = MemoryObjects()
    store = bucket(keep=2, objects=objects)
    owner = WriterIdentity.new("run-a")
    store.prepare(owner)
    save(store, 100, owner=owner, tag="a1")
    save(store, 200, owner=owner, tag="a2")
    # Another run's checkpoint in the same prefix (a job that wrote here before): 200's files, run-b's manifest.
    for key, value in list(objects.objects.items()):
        if key.startswith(f"{PREFIX}/step_00000200/"):
            objects.objects[key.replace("step_00000200", "step_00000250")] = value
    key = f"{PREFIX}/step_00000250/{MANIFEST}"
    raw = json.loads(objects.objects[key][0])
    objects.objects[key] = (json.dumps({**raw, "step": 250, "run_id": "run-b"}).encode(), '"b"', 0.0)
    # This run's checkpoint whose shard lost bytes: its manifest commits it, but it does not check.
    save(store, 300, owner=owner, tag="a3")
    shard = f"{PREFIX}/step_00000300/a3/shard_00000.bin"
    objects.objects[shard] = (objects.objects[shard][0][:-8],) + objects.objects[shard][1:]
    fresh = bucket(keep=2, objects=objects)  # another process: nothing counted yet
    save(fresh, 400, owner=owner, tag="a4")
    assert steps(fresh) == [400, 300, 250, 200], "300 does not count: 400 and 200 stay; 100 goes"
    save(fresh, 500, owner=owner, tag="a5")
    assert steps(fresh) == [500, 400, 250]
    assert keys(objects, "step_00000200") == [] and keys(objects, "step_00000300") == []


def test_a_damaged_checkpoint_fails_verification_and_is_moved_aside() -> None:
    objects = MemoryObjects()
    store = bucket(objects=objects)
    owner = WriterIdentity.new("run-a")
    store.prepare(owner)
    save(store, 100, owner=owner)
    shard = f"{PREFIX}/step_00000100/t1/shard_00000.bin"
    data = bytearray(objects.objects[shard][0])
    data[100] ^= 0xFF
    objects.objects[shard] = (bytes(data),) + objects.objects[shard][1:]
    (candidate,) = store.committed()
    with pytest.raises(CorruptCheckpoint, match="fails its crc32c check"):
        store.verify(candidate)
    store.quarantine(candidate)
    assert store.committed() == [] and len(keys(objects, "corrupt/")) == 1


@pytest.mark.parametrize("damage, why", [
    (lambda m: {**m, "parts": "../other"}, "names no upload folder"),
    (lambda m: {**m, "files": {"../../etc/passwd": {"bytes": 1}}}, "not a bare name|file"),
    (lambda m: {**m, "step": 7}, "says step 7"),
])
def test_a_crafted_manifest_is_corrupt_never_followed(damage, why: str) -> None:
    objects = MemoryObjects()
    store = bucket(objects=objects)
    owner = WriterIdentity.new("run-a")
    store.prepare(owner)
    save(store, 100, owner=owner)
    key = f"{PREFIX}/step_00000100/{MANIFEST}"
    objects.objects[key] = (json.dumps(damage(json.loads(objects.objects[key][0]))).encode(), '"x"', 0.0)
    with pytest.raises(CorruptCheckpoint, match=why):
        bucket(objects=objects).read_checked_manifest(Candidate("step_00000100", 100, None))


def test_an_oversized_manifest_is_never_read() -> None:
    objects = MemoryObjects()
    objects.put(f"{PREFIX}/step_00000001/{MANIFEST}", b" " * (16 * 2**20 + 1))
    store = bucket(objects=objects)
    with pytest.raises(CorruptCheckpoint, match="larger than"):
        store.read_manifest(store.committed()[0])


# -- parallel ranges -------------------------------------------------------------------------


def test_an_upload_streams_in_bounded_parts_and_appears_only_when_complete() -> None:
    objects = MemoryObjects()
    data = torch.arange(100_000, dtype=torch.int32).numpy().tobytes()
    upload = PartUpload(objects, "k", piece=64 * 1024)
    for at in range(0, len(data), 10_000):
        upload.write(memoryview(data)[at : at + 10_000])
        assert "k" not in objects.objects, "invisible until completed"
    upload.close()
    assert objects.objects["k"][0] == data and upload.bytes == len(data)
    assert sum(op == "upload_part" for op, _ in objects.requests) == -(-len(data) // (64 * 1024))
    # Create-only: an upload never replaces an object.
    again = PartUpload(objects, "k", piece=64 * 1024)
    again.write(data)
    with pytest.raises(ConditionFailed):
        again.close()
    assert objects.objects["k"][0] == data and objects.uploads == {}


def test_a_failing_part_drops_the_whole_upload() -> None:
    objects = MemoryObjects()
    objects.fail = lambda op, key: op == "upload_part"
    upload = PartUpload(objects, "k", piece=1024)
    with pytest.raises(StoreUnavailable):
        with upload:
            for _ in range(50):
                upload.write(b"x" * 1024)
    assert "k" not in objects.objects and objects.uploads == {}


def test_ranged_reads_fetch_ahead_and_report_short_and_missing_objects() -> None:
    objects = MemoryObjects()
    data = bytes(range(256)) * 1000
    objects.put("p/f", data)
    source = BucketChunks(objects, lambda f: f"p/{f}", piece=4096)
    spans = [("f", 0, 10_000), ("f", 10_000, 100_000), ("f", 200_000, 256_000)]
    source.expect(spans)
    for file, start, stop in spans:
        assert bytes(source.view(file, start, stop)) == data[start:stop]
    assert source.view("f", 255_000, 257_000) is None, "shorter than the span: a truncated file"
    with pytest.raises(FileNotFoundError):
        source.view("missing", 0, 10)
    source.close()
    stored = chunks.StoredChunk("f", 0, 64, "torch.float32", (16,), (0,), 1024)
    with pytest.raises(CorruptCheckpoint, match="fails its crc32c check"):
        chunks.read_rows(Candidate("x", 1, None).path or __import__("pathlib").Path("x"), stored, "w", None,
                         source=BucketChunks(objects, lambda f: f"p/{f}"))


class Killed(BaseException):
    """The process died at this request: it makes no other."""


def test_a_hundred_kills_at_random_requests_lose_nothing() -> None:
    """The quick form of the soak (benchmarks/object_store_soak.py kills real processes): a job that
    saves every step dies at a random request of its save, its commit, its claim or its retention,
    100 times; each restart resumes from the newest committed checkpoint, which verifies, and the
    last step is reached with every committed checkpoint whole and no upload left behind."""
    import random

    objects, rng, kills, target = MemoryObjects(), random.Random(45), 0, None
    while True:
        dead, countdown = [False], [rng.randint(1, 40) if kills < 100 else 10**9]

        def strike(op: str, key: str) -> None:
            countdown[0] -= 1
            if dead[0] or countdown[0] <= 0:
                dead[0] = True
                raise Killed(f"{op} {key}")

        objects.before = lambda op, key: None
        store = bucket(keep=2, objects=objects)
        committed = store.committed()
        for candidate in committed:  # whatever the kills did, a committed checkpoint is whole
            assert torch.equal(weights(store, candidate.step), torch.full((64, 32), float(candidate.step)))
        step = committed[0].step if committed else 0
        if kills == 100 and target is None:
            target = step + 3  # after the last kill, the job runs on to its end
        if step == target:
            break
        objects.before = strike  # from here on this "process" may die at any request
        try:
            owner = WriterIdentity.new("run-a")
            store.prepare(owner)
            while target is None or step < target:
                step += 1
                save(store, step, owner=owner, tag=f"t{rng.getrandbits(32):08x}")
        except (Killed, CheckpointException):  # DCP hands a death inside its writer on as its own exception
            assert dead[0]
            kills += 1
    assert kills == 100
    assert [c.step for c in store.committed()] == [step, step - 1]
    kept = (f"step_{step:08d}/", f"step_{step - 1:08d}/")
    leftovers = [k for k in keys(objects) if k not in ("writer.json", "latest") and not k.startswith(kept)]
    assert leftovers == [], "every upload a kill left was deleted by a later claim or commit"
    # (Multipart uploads a kill left incomplete are invisible; the bucket's lifecycle rule drops them.)
