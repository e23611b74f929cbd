"""The GPT recipe checkpointing into a local S3 server (moto): killed mid-upload and between its last
part and its manifest, it ends bit-identical to an uninterrupted run; relaunched on a fresh node with
nothing local, at another world size, it resumes from the bucket alone. Two job starts in all."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch
import warm
from references import REFERENCE_STEPS, References, gpt_args
from support import REPO, run_recipe, standalone_command, worker_env

from elastic._shared.storage.manifest import MANIFEST, TRAINER_FILE
from elastic._shared.storage.object_store.bucket import BucketStore
from elastic._shared.storage.stores import open_store
from elastic._worker.checkpoint import read_checkpoint
from elastic._worker.checkpoint.reader import read_tensors
from elastic._worker.observe.events import read_events
from elastic.chaos.faults import ONCE_DIR_ENV
from elastic.chaos.s3_server import S3Server

pytestmark = pytest.mark.slow


def newest_in_bucket(store: BucketStore) -> tuple[int, int, dict[str, torch.Tensor], dict]:
    """(step, saved world size, every tensor, trainer state) of the newest checkpoint, every byte verified."""
    candidate = store.committed()[0]
    manifest = store.verify(candidate)
    trainer = store.load_state_file(candidate, manifest, TRAINER_FILE)
    return manifest.step, manifest.world_size, read_tensors(store, candidate, manifest, trainer), trainer


def test_kills_during_upload_and_commit_lose_nothing_and_a_fresh_node_resumes_from_the_bucket(
    tmp_path: Path, s3_server: S3Server, shared_corpus: Path, references: References, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = f"job-{uuid.uuid4().hex[:10]}"
    s3_server.create_bucket(bucket)
    url = f"s3://{bucket}/gpt/run1"
    env = s3_server.environment()
    for key, value in env.items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)
    events = tmp_path / "events.jsonl"
    (tmp_path / "once").mkdir()
    # Rank 1 dies while its shard of step 20 is being uploaded; rank 0 dies at step 40 after every
    # part is uploaded and before the manifest is created. Plain torchrun restarts both workers.
    faults = "during_write@20:rank=1:restart=any:once,before_commit@40:restart=any:once"
    args = [*gpt_args(shared_corpus), "--ckpt-dir", url, "--ckpt-every", "10", "--events", str(events)]
    result = warm.run(standalone_command(2, args, max_restarts=3), timeout=300, cwd=REPO,
                      env=worker_env(**env, ELASTIC_FAULT=faults, **{ONCE_DIR_ENV: str(tmp_path / "once")}))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]

    records = list(read_events(events))
    restores = [(e["step"], e["world_size"], e["source"]) for e in records if e["event"] == "restore"]
    assert restores == [(10, 2, "disk"), (30, 2, "disk")], "each kill resumed from the bucket's newest commit"
    commits = [e["step"] for e in records if e["event"] == "checkpoint"]
    assert commits == [10, 20, 30, 40, 50, 60], "the killed saves never committed; their steps were saved again"

    store = open_store(url, keep=3)
    assert isinstance(store, BucketStore)
    assert [c.step for c in store.committed()] == [60, 50, 40], "retention kept the newest three"
    # Nothing torn is left behind: every object is a committed checkpoint's, the claim or `latest`.
    named = {c.name: store.read_checked_manifest(c).parts for c in store.committed()}
    for info in store.objects.list("gpt/run1/"):
        rest = info.key[len("gpt/run1/"):].split("/")
        assert rest in (["writer.json"], ["latest"], [rest[0], MANIFEST]) or named.get(rest[0]) == rest[1], info.key

    # Bit-identical to the uninterrupted run: model, optimizer state and settings.
    step, world, got, got_trainer = newest_in_bucket(store)
    assert (step, world) == (REFERENCE_STEPS, 2)
    _, want, want_trainer = read_checkpoint(references.final_checkpoint(gpt_args(shared_corpus), REFERENCE_STEPS))
    for prefix in ("model/", "optim/"):
        keys = [k for k in want if k.startswith(prefix)]
        assert keys and keys == [k for k in got if k.startswith(prefix)]
        assert all(torch.equal(want[k], got[k]) for k in keys), f"{prefix} differs from the uninterrupted run"
    assert got_trainer["optimizer"] == want_trainer["optimizer"]

    # A fresh node: another working directory, nothing local, one process (world size 1, saved at 2).
    fresh = tmp_path / "fresh-node"
    fresh.mkdir()
    again = run_recipe(*gpt_args(shared_corpus, REFERENCE_STEPS + 6), "--ckpt-dir", url, "--ckpt-every", "0",
                       "--events", str(fresh / "events.jsonl"), env=worker_env(**env), timeout=180)
    assert again.returncode == 0, again.stderr[-3000:]
    (restore,) = [e for e in read_events(fresh / "events.jsonl") if e["event"] == "restore"]
    assert (restore["step"], restore["saved_world_size"], restore["world_size"]) == (REFERENCE_STEPS, 2, 1)
    assert restore["bytes_read"] > 0
    assert not (REPO / "s3:").exists() and not (fresh / "s3:").exists(), "no local folder stands in for the bucket"
    step, world, resumed, _ = newest_in_bucket(open_store(url))
    assert (step, world) == (REFERENCE_STEPS + 6, 1)
    assert resumed.keys() == got.keys()
