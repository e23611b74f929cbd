"""Checkpoints in a real local S3 server (moto, tests/conftest.py's `s3_server`), in this process:
first that the server enforces conditional writes at all, then the commit, restore, retention and
claim through boto3, and the one-line refusals at start (elastic/_shared/storage/object_store)."""

from __future__ import annotations

import uuid

import botocore.exceptions
import pytest
import torch

from elastic._shared.common.errors import CheckpointStorageError, CorruptCheckpoint, UsageError
from elastic._shared.storage import sharded
from elastic._shared.storage.claim import WriterIdentity
from elastic._shared.storage.commit import commit_checkpoint
from elastic._shared.storage.object_store.bucket import BucketStore
from elastic._shared.storage.object_store.objects import ConditionFailed
from elastic._shared.storage.object_store.transfer import PartUpload
from elastic._shared.storage.stores import open_store
from elastic.chaos.netns import free_port
from elastic.chaos.s3_server import S3Server


@pytest.fixture
def bucket_url(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket on the server, and this process's environment pointed at it."""
    name = f"b-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(name)
    for key, value in s3_server.environment().items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)
    return f"s3://{name}/runs/gpt"


def test_the_server_enforces_conditional_writes(s3_server: S3Server, bucket_url: str) -> None:
    """Many S3 emulators ignore If-None-Match: the commit would then be no commit. This one refuses."""
    client, bucket = s3_server.client(), bucket_url[5:].split("/")[0]
    first = client.put_object(Bucket=bucket, Key="k", Body=b"first", IfNoneMatch="*")
    with pytest.raises(botocore.exceptions.ClientError) as second:
        client.put_object(Bucket=bucket, Key="k", Body=b"second", IfNoneMatch="*")
    assert second.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    with pytest.raises(botocore.exceptions.ClientError) as stale:
        client.put_object(Bucket=bucket, Key="k", Body=b"third", IfMatch='"0123456789abcdef0123456789abcdef"')
    assert stale.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    client.put_object(Bucket=bucket, Key="k", Body=b"fourth", IfMatch=first["ETag"])
    assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"fourth"
    # And through our client: a create-only put is refused, the object untouched.
    store = open_store(bucket_url)
    assert isinstance(store, BucketStore)
    with pytest.raises(ConditionFailed):
        store.objects.put("k", b"fifth", create_only=True)
    assert store.objects.get("k", limit=100)[0] == b"fourth"


def save(store: BucketStore, step: int, owner: WriterIdentity | None, fill: float, tag: str, **kwargs) -> str:
    stage = store.begin(step, tag)
    # 20 MiB: a multipart upload of two parts, the second shorter.
    writer = sharded.save_tensors({"model/w": torch.full((5 * 2**20,), fill)}, stage, group=None,
                                  sink=store.part_sink(stage))
    return commit_checkpoint(
        store, stage, step=step, world_size=1, shard_sizes=writer.file_sizes,
        tensors_json=writer.tensors_json.encode(), trainer={"sampler": {"epoch": 0, "consumed": step}},
        reason="periodic", run_id="run-a", owner=owner, **kwargs,
    )


def restored(store: BucketStore, step: int) -> torch.Tensor:
    (candidate,) = [c for c in store.committed() if c.step == step]
    manifest = store.verify(candidate)
    target = {"model/w": torch.empty(5 * 2**20)}
    sharded.load_tensors(target, candidate.path, store.tensor_metadata(candidate, manifest), group=None,
                         source=store.chunk_source(candidate.path))
    return target["model/w"]


def test_commit_restore_retention_and_claim_on_a_real_server(s3_server: S3Server, bucket_url: str) -> None:
    store = open_store(bucket_url, keep=2)
    assert isinstance(store, BucketStore)
    owner = WriterIdentity.new("run-a")
    store.prepare(owner)
    for step in (100, 200):
        save(store, step, owner, float(step), f"a{step}")
    assert torch.equal(restored(store, 200), torch.full((5 * 2**20,), 200.0))

    def killed() -> None:
        raise KeyboardInterrupt  # dies between the last part and the manifest

    with pytest.raises(KeyboardInterrupt):
        save(store, 300, owner, 300.0, "a300", before_commit=killed)
    assert [c.step for c in store.committed()] == [200, 100], "a torn upload is never a checkpoint"
    # Retention after a newer commit: 100 goes, the orphan of 300 too (its step is behind the commit).
    save(store, 400, owner, 400.0, "a400")
    assert [c.step for c in store.committed()] == [400, 200]
    keys = [o.key for o in store.objects.list("runs/gpt/")]
    assert not any("step_00000100" in k or "step_00000300" in k for k in keys), keys
    assert store.latest_pointer() == "step_00000400"
    # A damaged object is found by the restore's checks, and the previous checkpoint is whole.
    shard = next(k for k in keys if "step_00000400" in k and k.endswith("shard_00000.bin"))
    client, bucket = s3_server.client(), bucket_url[5:].split("/")[0]
    client.delete_object(Bucket=bucket, Key=shard)
    client.put_object(Bucket=bucket, Key=shard, Body=b"\0" * (20 * 2**20))
    with pytest.raises(CorruptCheckpoint, match="crc32c"):
        store.verify(store.committed()[0])
    assert torch.equal(restored(store, 200), torch.full((5 * 2**20,), 200.0))
    # The claim: another live job is refused; this one's heartbeat is a conditional replace.
    other = open_store(bucket_url)
    with pytest.raises(CheckpointStorageError, match="written by another job"):
        other.prepare(_live_other_job())
    store.heartbeat(owner)
    assert store.writer().writer == owner.writer
    # A completed multipart upload is create-only too: a committed shard is never replaced.
    upload = PartUpload(store.objects, shard)
    upload.write(b"\1" * (6 * 2**20))
    upload.write(b"\1" * (12 * 2**20))
    with pytest.raises(ConditionFailed):
        upload.close()
    assert store.objects.head(shard) == 20 * 2**20


def _live_other_job() -> WriterIdentity:
    import os

    from store_helpers import claim_of

    return claim_of("run-b", pid=os.getppid())


def test_bad_credentials_a_missing_bucket_or_no_server_are_one_line_at_start(
    s3_server: S3Server, bucket_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(UsageError, match=r"^--ckpt-dir s3://nonexistent-bucket-45/x: .*does not exist$"):
        open_store("s3://nonexistent-bucket-45/x")
    # moto accepts any key; a server that checks them answers 403, which reads so:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    with pytest.raises(UsageError, match="no credentials") as missing:
        open_store(bucket_url)
    assert "\n" not in str(missing.value)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLEKEY")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "do-not-print-this-secret")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with pytest.raises(UsageError, match="Could not connect to the endpoint URL") as unreachable:
        open_store(bucket_url)
    assert "do-not-print-this-secret" not in str(unreachable.value) and "\n" not in str(unreachable.value)


def test_the_memory_tier_and_the_keeper_work_in_front_of_a_bucket(keeper, bucket_url: str, monkeypatch) -> None:
    """Snapshots still go to node memory; the keeper persists the newest through the bucket's one commit,
    and a run without memory (a whole-job crash) resumes from the bucket, bit-identical."""
    from test_snapshots import Job, assert_same

    job = Job(bucket_url)
    job.run(8)  # committed at step 5 in the bucket; snapshots of 7 and 8 in memory
    job.ckpt.flush()
    job.ckpt.memory.wait_previous()
    want = job.state()
    job.close()
    assert keeper.persist() == [8]
    store = open_store(bucket_url)
    newest = store.committed()[0]
    assert (newest.name, store.verify(newest).reason) == ("step_00000008", "breakpoint")
    assert keeper.persist() == [], "nothing newer than what is committed"
    folder = f"runs/gpt/step_00000008/{store.read_checked_manifest(newest).parts}/"
    assert sorted(o.key[len(folder):] for o in store.objects.list(folder)) == [
        "shard_00000.bin", "tensors.json", "trainer.pt"], "the keepers' markers and headers are gone"
    monkeypatch.delenv("TORCHREVIVE_SNAPSHOT_ROOT")
    fresh = Job(bucket_url, seed=2, snapshot_every=0)
    assert fresh.ckpt.restore() == 8
    assert_same(want, fresh.state())
    fresh.close()


def test_throttling_is_retried_and_a_failing_store_follows_the_full_disk_policy(
    s3_server: S3Server, bucket_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flaky_s3 import FlakyS3
    from test_snapshots import Job

    with FlakyS3(s3_server.url) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        store = open_store(bucket_url)
        owner = WriterIdentity.new("run-a")
        store.prepare(owner)
        # A throttled store (503 SlowDown) and a failing one (500): retried with backoff, the save goes through.
        answers = iter([(503, "SlowDown"), (500, "InternalError")])

        def twice(method: str, path: str) -> bool:
            if method != "PUT":
                return False
            try:
                proxy.status, proxy.code = next(answers)
            except StopIteration:
                return False
            return True

        proxy.fail = twice
        save(store, 100, owner, 1.0, "a100")
        assert proxy.failed == 2 and [c.step for c in store.committed()] == [100]

        # Saves that keep failing: warnings, training goes on, then the storage stop; the last good checkpoint stays.
        job = Job(bucket_url + "-job")
        job.run(5)
        job.ckpt.flush()
        proxy.status, proxy.code = 403, "AccessDenied"  # not retried: each save fails at once
        proxy.fail = lambda method, path: method in ("PUT", "POST")
        step = 5
        while not job.ckpt.must_stop and step < 40:
            step = job.run(5, start=step)
            job.ckpt.saver.collect(block=True)
        assert job.ckpt.must_stop, "three failed saves in a row stop the job"
        assert [h["step"] for h in job.ckpt.history] == [5]
        assert "3 checkpoints in a row failed" in job.ckpt.stop_reason
        assert "access denied" in job.ckpt.stop_reason
        assert f"{bucket_url}-job/step_00000005, is intact" in job.ckpt.stop_reason
        proxy.fail = lambda method, path: False
        job.close()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.url)
    store = open_store(bucket_url + "-job")
    assert [c.step for c in store.committed()][:1] == [5]
    store.verify(store.committed()[0])


def test_the_server_gone_in_the_middle_of_a_save_is_retried_and_the_save_commits(
    s3_server: S3Server, bucket_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart of the server (moto keeps nothing across one: here its window of closed connections)
    between the shard's parts and the commit: every request retried, nothing torn, the save commits."""
    from flaky_s3 import FlakyS3

    with FlakyS3(s3_server.url) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        store = open_store(bucket_url)
        owner = WriterIdentity.new("run-a")
        store.prepare(owner)
        gone = {"after": None}

        def outage(method: str, path: str) -> bool:
            if "partNumber=2" in path and gone["after"] is None:
                gone["after"] = 0  # the second part of the shard: from here the server is gone for 4 requests
            if gone["after"] is not None and gone["after"] < 4:
                gone["after"] += 1
                return True
            return False

        proxy.drop = outage
        save(store, 100, owner, 2.5, "a100")
        assert proxy.dropped == 4
        assert torch.equal(restored(store, 100), torch.full((5 * 2**20,), 2.5))
        assert [o.key.rsplit("/", 1)[-1] for o in store.objects.list("runs/gpt/step_00000100/")] == [
            "shard_00000.bin", "tensors.json", "trainer.pt", "manifest.json"]


def test_a_restore_skips_a_damaged_checkpoint_in_the_bucket_and_moves_it_aside(bucket_url: str) -> None:
    from test_snapshots import Job

    job = Job(bucket_url + "-restore", snapshot_every=0)
    job.run(10)  # committed at 5 and 10
    job.ckpt.flush()
    job.close()
    store = open_store(bucket_url + "-restore")
    newest = store.committed()[0]
    shard = f"runs/gpt-restore/step_00000010/{store.read_checked_manifest(newest).parts}/shard_00000.bin"
    data = bytearray(store.objects.get(shard, limit=2**30)[0])
    data[len(data) // 2] ^= 0xFF
    store.objects.delete([shard])
    store.objects.put(shard, bytes(data))
    fresh = Job(bucket_url + "-restore", seed=2, snapshot_every=0)
    assert fresh.ckpt.restore() == 5, "the damaged step 10 is skipped for step 5"
    fresh.close()
    assert [c.step for c in store.committed()] == [5]
    assert [o.key.rsplit("/", 1)[-1].split(".")[0] for o in store.objects.list("runs/gpt-restore/corrupt/")] == [
        "step_00000010"]


def test_a_read_the_store_trickles_ends_by_its_deadline(s3_server: S3Server, bucket_url: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Probe (issue 55, L): 16 bytes sent a byte at a time, each within the read timeout, took 16 s under a
    2 s read timeout: no deadline covered the whole read. Now one does: the read is abandoned with one line
    while the server is still sending, and a whole body still reads whole."""
    from flaky_s3 import FlakyS3

    from elastic._shared.storage.object_store import s3
    from elastic._shared.storage.object_store.objects import StoreUnavailable

    monkeypatch.setattr(s3, "READ_TIMEOUT", 2.0)
    monkeypatch.setattr(s3, "READ_DEADLINE", 1.0)
    with FlakyS3(s3_server.url) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        store = open_store(bucket_url)
        store.objects.put("slow", b"0123456789abcdef")
        assert store.objects.get("slow", limit=100)[0] == b"0123456789abcdef"
        proxy.trickle = lambda method, path: 0.5 if method == "GET" else None
        for read in (lambda: store.objects.get("slow", limit=100), lambda: store.objects.get_range("slow", 0, 16)):
            before = proxy.trickled
            with pytest.raises(StoreUnavailable, match="too slow"):
                read()
            assert proxy.trickled - before < 16, "the read waited for the whole trickled body"
