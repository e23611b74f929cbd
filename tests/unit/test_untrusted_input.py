"""What a peer, a disk or a restart hands us is parsed or refused, never a crash.

Every parser of untrusted input (part headers, manifests, tensors.json, stored
chunks) either returns a valid object or raises `CorruptCheckpoint`, whatever
it is given: arbitrary JSON, arbitrary bytes, or a valid document with one
value changed. Property tests run a modest, fixed set of examples
(`derandomize`), so the tier stays fast and never flaky.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import Metadata

from elastic._shared.common.errors import CorruptCheckpoint
from elastic._shared.storage import parts, sharded, tensors_json
from elastic._shared.storage.chunks import (
    BLOCK,
    StoredChunk,
    block_checksums,
    read_chunk,
)
from elastic._shared.storage.directory import CheckpointStore
from elastic._shared.storage.manifest import (
    MANIFEST,
    TRAINER_FILE,
    Candidate,
    Manifest,
    versions,
)
from elastic._worker.checkpoint import CheckpointManager, load_newest_model_state
from elastic._worker.checkpoint.memory import Inventory
from elastic._worker.checkpoint.memory_source import MemorySource
from elastic._worker.config import RunConfig
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.runtime.context import init_worker

PROPERTY = settings(
    max_examples=60, derandomize=True, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
"""Few examples, the same ones every run (CI must not be flaky), no wall-clock deadline."""

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
"""Any JSON value (floats include NaN and infinities: Python's json writes and reads them)."""


# -- valid documents ---------------------------------------------------------------


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def chunk_doc(file: str, offset: int, tensor: torch.Tensor) -> dict[str, Any]:
    data = memoryview(raw_bytes(tensor))
    return StoredChunk(
        file, offset, len(data), str(tensor.dtype), tuple(tensor.shape), tuple(block_checksums(data, BLOCK)), BLOCK
    ).to_json()


def part_doc() -> tuple[dict[str, Any], bytes]:
    """A valid one-rank part header and its data file: a float tensor in two row chunks, a scalar."""
    weight, scalar = torch.arange(8.0).reshape(4, 2), torch.tensor(3, dtype=torch.int64)
    stem = parts.part_stem(0, "1a2b-c0ffee", 1)
    top, bottom = weight[:2], weight[2:]
    data = b"".join(raw_bytes(t) for t in (top, bottom, scalar))
    chunks = [
        {"fqn": "model/w", "at": [0, 0], **chunk_doc(stem + ".bin", 0, top)},
        {"fqn": "model/w", "at": [2, 0], **chunk_doc(stem + ".bin", 16, bottom)},
        {"fqn": "model/n", "at": [], **chunk_doc(stem + ".bin", 32, scalar)},
    ]
    trainer, trainer_crc = parts.encode_trainer({"rng": [{"torch": torch.zeros(2, dtype=torch.uint8)}], "sampler": {"epoch": 0}})
    header = parts.PartHeader(
        run_id="job-1", step=7, rank=0, world_size=1, writer="1a2b-c0ffee", slot=1, data_bytes=len(data),
        chunks=chunks, tensors={"model/w": {"dtype": "torch.float32", "size": [4, 2]},
                                "model/n": {"dtype": "torch.int64", "size": []}},
        trainer=trainer, trainer_crc32c=trainer_crc, ckpt_dir="/ckpt", keep=2, created=1.5,
        extra={"generation": "g1"},
    )
    return json.loads(header.to_json()), data


def tensors_doc() -> tuple[dict[str, Any], bytes]:
    """A valid tensors.json (as `part_doc`'s tensors, in one shard file) and that file."""
    header, data = part_doc()
    metadata = parts.merged_metadata([parts.PartHeader.from_json(json.dumps(header))])
    return json.loads(tensors_json.metadata_to_json(metadata)), data


def manifest_doc(files: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    return json.loads(Manifest(
        step=7, epoch=0, consumed=12, world_size=1, files=files or {"trainer.pt": {"bytes": 3, "crc32c": 5}},
        created=1.5, reason="every", run_id="job-1", versions=versions(),
    ).to_json())


@pytest.fixture(scope="module")
def part_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with `part_doc`'s data file (the property tests read it through mutated headers)."""
    directory = tmp_path_factory.mktemp("part")
    header, data = part_doc()
    (directory / (parts.part_stem(0, header["writer"], header["slot"]) + parts.DATA_SUFFIX)).write_bytes(data)
    return directory


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("shard")
    _, data = tensors_doc()
    (directory / sharded.shard_file(0)).write_bytes(data)
    return directory


# -- mutations -----------------------------------------------------------------------


def _paths(value: Any, here: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [here]
    if isinstance(value, dict):
        for key, child in value.items():
            found += _paths(child, (*here, key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            found += _paths(child, (*here, i))
    return found


@st.composite
def mutated(draw: st.DrawFn, doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` with one value replaced by any JSON, or one key or item removed."""
    doc = copy.deepcopy(doc)
    path = draw(st.sampled_from(_paths(doc)[1:]))
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    if draw(st.booleans()):
        parent[path[-1]] = draw(JSON | st.integers(-3, 2**64) | st.sampled_from(["../x", "/dev/zero", "torch.Size"]))
    else:
        del parent[path[-1]]
    return doc


def corrupt_or(parse: Any, raw: Any) -> Any:
    """`parse(raw)`, or None when it raises `CorruptCheckpoint` (anything else fails the test)."""
    try:
        return parse(raw)
    except CorruptCheckpoint as exc:
        assert "\n" not in str(exc), "errors are one line"
        return None


# -- part headers --------------------------------------------------------------------


def test_a_valid_part_header_round_trips(part_dir: Path) -> None:
    doc, data = part_doc()
    header = parts.PartHeader.from_json(json.dumps(doc))
    assert parts.PartHeader.from_json(header.to_json()) == header
    assert parts.read_data(part_dir / (header.stem + parts.DATA_SUFFIX), header) == bytearray(data)
    assert parts.merged_trainer([header])["sampler"] == {"epoch": 0}


@PROPERTY
@given(JSON)
def test_any_json_is_a_part_header_or_corrupt(raw: Any) -> None:
    corrupt_or(parts.PartHeader.from_json, json.dumps(raw))


@PROPERTY
@given(st.binary(max_size=64))
def test_any_bytes_are_a_part_header_or_corrupt(raw: bytes) -> None:
    corrupt_or(parts.PartHeader.from_json, raw)


@PROPERTY
@given(mutated(part_doc()[0]))
def test_a_changed_part_header_parses_and_reads_or_is_corrupt(part_dir: Path, doc: dict[str, Any]) -> None:
    header = corrupt_or(parts.PartHeader.from_json, json.dumps(doc))
    if header is None:
        return
    assert parts.PartHeader.from_json(header.to_json()) == header, "what parses round-trips"
    # What parses is safe to use: reading, merging and decoding raise nothing but CorruptCheckpoint.
    corrupt_or(lambda h: parts.read_data(part_dir / (parts.part_stem(0, "1a2b-c0ffee", 1) + ".bin"), h), header)
    metadata = corrupt_or(lambda h: parts.merged_metadata([h]), header)
    assert metadata is None or isinstance(metadata, Metadata)
    corrupt_or(lambda h: parts.merged_trainer([h]), header)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"step": []}, "step is \\[\\], not an integer"),
        ({"step": True}, "step is true, not an integer"),
        ({"rank": 1}, "rank is 1, outside 0..0"),
        ({"world_size": 0}, "world_size is 0"),
        ({"slot": 2}, "slot is 2"),
        ({"writer": "../../x"}, "writer"),
        ({"data_bytes": 20}, "chunk 1 ends at byte 32, beyond its data's 20"),
        ({"keep": 0}, "keep is 0"),
        ({"trainer_crc32c": 2**32}, "trainer_crc32c"),
        ({"created": float("nan")}, "created is nan"),
        ({"surprise": 1}, "unknown fields"),
    ],
)
def test_a_malformed_part_header_is_refused_naming_the_field(change: dict[str, Any], message: str) -> None:
    doc, _ = part_doc()
    with pytest.raises(CorruptCheckpoint, match=message):
        parts.PartHeader.from_json(json.dumps({**doc, **change}))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c.update(length=17), "is 17 bytes long, its sizes \\[2, 2\\] of torch.float32 make 16"),
        (lambda c: c.update(crc32c=[1, 2]), "has 2 checksums for 16 bytes"),
        (lambda c: c.update(crc32c=[-1]), "crc32c\\[0\\] is -1"),
        (lambda c: c.update(block=0), "block is 0"),
        (lambda c: c.update(at=[3, 0]), "lies outside 'model/w'"),
        (lambda c: c.update(at=[0]), "does not fit 'model/w'"),
        (lambda c: c.update(dtype="torch.int32", length=16), "holds torch.int32, its tensor 'model/w' is torch.float32"),
        (lambda c: c.update(fqn="model/other"), "not declared"),
        (lambda c: c.update(file="/dev/zero"), "not a plain file name"),
        (lambda c: c.update(file=".."), "not a plain file name"),
    ],
)
def test_a_malformed_chunk_of_a_part_is_refused(change: Any, message: str) -> None:
    doc, _ = part_doc()
    change(doc["chunks"][0])
    with pytest.raises(CorruptCheckpoint, match=message):
        parts.PartHeader.from_json(json.dumps(doc))


def test_read_headers_skips_a_malformed_header_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    doc, data = part_doc()
    good = parts.PartHeader.from_json(json.dumps(doc))
    (tmp_path / (good.stem + parts.DATA_SUFFIX)).write_bytes(data)
    parts.write_header(tmp_path, good)
    bad_stem = parts.part_stem(0, "1a2b-c0ffee", 0)
    (tmp_path / (bad_stem + parts.DATA_SUFFIX)).write_bytes(data)
    (tmp_path / (bad_stem + parts.HEADER_SUFFIX)).write_text(json.dumps({**doc, "slot": 0, "step": []}))
    with caplog.at_level(logging.WARNING, logger="elastic._shared.storage.parts"):
        assert parts.read_headers(tmp_path) == [good]
        assert parts.read_headers(tmp_path) == [good]  # the keeper's maintenance reads them every few seconds
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "step is []" in warnings[0].getMessage() and bad_stem in warnings[0].getMessage()


def test_read_data_never_allocates_more_than_the_file_holds(tmp_path: Path) -> None:
    doc, data = part_doc()
    header = parts.PartHeader.from_json(json.dumps({**doc, "data_bytes": 2**60}))
    path = tmp_path / "part.bin"
    path.write_bytes(data)
    with pytest.raises(CorruptCheckpoint, match="is truncated"):
        parts.read_data(path, header)


def test_a_restore_plan_skips_malformed_parts_of_any_node() -> None:
    doc, _ = part_doc()
    bad_trainer, crc = parts.encode_trainer({"not": "a trainer state"})
    source = MemorySource(
        init_worker("cpu", environ={}), None, None, ckpt_dir="/ckpt", tag="t", newest_on_disk=0,  # type: ignore[arg-type]
        deadline=0.0,
    )
    inventory = Inventory("node-a", "http://a", None, [
        ["local", json.dumps({**doc, "step": []})],
        ["local", "not json"],
        ["../..", json.dumps(doc)],
        ["local"],
        ["local", json.dumps({**doc, "trainer": bad_trainer, "trainer_crc32c": crc})],
    ])
    assert source._plan([inventory]) is None


# -- stored chunks and tensors.json --------------------------------------------------


@PROPERTY
@given(JSON)
def test_any_json_is_a_stored_chunk_or_corrupt(raw: Any) -> None:
    corrupt_or(StoredChunk.from_json, raw)


@PROPERTY
@given(mutated(tensors_doc()[0]["chunks"][0]))
def test_a_changed_stored_chunk_reads_or_is_corrupt(shard_dir: Path, doc: dict[str, Any]) -> None:
    stored = corrupt_or(StoredChunk.from_json, doc)
    if stored is not None:
        assert StoredChunk.from_json(stored.to_json()) == stored
        corrupt_or(lambda s: read_chunk(shard_dir, s, "model/w"), stored)


@PROPERTY
@given(JSON)
def test_any_json_is_tensors_json_or_corrupt(raw: Any) -> None:
    corrupt_or(tensors_json.metadata_from_json, json.dumps(raw))


@PROPERTY
@given(mutated(tensors_doc()[0]))
def test_a_changed_tensors_json_verifies_or_is_corrupt(shard_dir: Path, doc: dict[str, Any]) -> None:
    _, data = tensors_doc()
    metadata = corrupt_or(lambda text: tensors_json.metadata_from_json(text, {sharded.shard_file(0): len(data)}), json.dumps(doc))
    if metadata is not None:
        assert tensors_json.metadata_from_json(tensors_json.metadata_to_json(metadata)) == metadata
        corrupt_or(lambda md: sharded.verify_tensors(shard_dir, md), metadata)


def test_tensors_json_must_cover_each_tensor_with_its_declared_chunks() -> None:
    doc, _ = tensors_doc()
    doc["chunks"] = [c for c in doc["chunks"] if c["at"] != [2, 0]]
    with pytest.raises(CorruptCheckpoint, match="the chunks declared for 'model/w' are not the chunks stored"):
        tensors_json.metadata_from_json(json.dumps(doc))
    doc["tensors"]["model/w"]["chunks"] = [{"offsets": [0, 0], "sizes": [2, 2]}]
    with pytest.raises(CorruptCheckpoint, match="do not make up its size"):
        tensors_json.metadata_from_json(json.dumps(doc))


def test_a_chunk_beyond_its_file_is_refused_before_any_read(tmp_path: Path) -> None:
    doc, data = tensors_doc()
    (tmp_path / sharded.shard_file(0)).write_bytes(data)
    with pytest.raises(CorruptCheckpoint, match="beyond the files of its checkpoint"):
        tensors_json.metadata_from_json(json.dumps(doc), {sharded.shard_file(0): len(data) - 1})
    # Without sizes to check against, the read itself stats the file before allocating anything.
    huge = StoredChunk(sharded.shard_file(0), 0, 2**40, "torch.float32", (2**38,), (0,) * 2**10, 2**30)
    with pytest.raises(CorruptCheckpoint, match="is truncated"):
        read_chunk(tmp_path, huge, "model/w")


def test_deeply_nested_or_huge_json_is_corrupt() -> None:
    with pytest.raises(CorruptCheckpoint, match="nested too deeply|not JSON"):
        tensors_json.metadata_from_json("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CorruptCheckpoint, match="more than the"):
        parts.PartHeader.from_json(b" " * (parts.MAX_HEADER_BYTES + 1))


# -- manifests and checkpoint directories -------------------------------------------


def test_a_valid_manifest_round_trips() -> None:
    manifest = Manifest.from_json(json.dumps(manifest_doc()))
    assert Manifest.from_json(manifest.to_json()) == manifest


@PROPERTY
@given(JSON)
def test_any_json_is_a_manifest_or_corrupt(raw: Any) -> None:
    corrupt_or(Manifest.from_json, json.dumps(raw))


@PROPERTY
@given(mutated(manifest_doc({"trainer.pt": {"bytes": 3, "crc32c": 5}, "model.pt": {"bytes": 1, "sha256": "0" * 64}})))
def test_a_changed_manifest_parses_or_is_corrupt(doc: dict[str, Any]) -> None:
    manifest = corrupt_or(Manifest.from_json, json.dumps(doc))
    if manifest is not None:
        assert Manifest.from_json(manifest.to_json()) == manifest
        assert all("/" not in name and name not in (".", "..") for name in manifest.files)


class Job:
    """A tiny model trained and saved through the real CheckpointManager, in one process."""

    def __init__(self, ckpt_dir: Path) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.sampler = ElasticSampler(40, batch_size=4, seed=3)
        self.ckpt = CheckpointManager(
            init_worker("cpu", environ={}), RunConfig(ckpt_dir=ckpt_dir, ckpt_every=2, seed=3), model=self.model,
            optimizer=self.optimizer, sampler=self.sampler,
        )

    def run(self, steps: int) -> None:
        for step in range(1, steps + 1):
            self.model(torch.randn(4, 4)).pow(2).mean().backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.sampler.advance(1)
            self.ckpt.maybe_save(step)
        self.ckpt.flush()
        self.ckpt.close()


@pytest.fixture
def two_checkpoints(tmp_path: Path) -> Path:
    """A directory with committed steps 2 and 4; tests craft step 4."""
    Job(tmp_path / "ckpt").run(4)
    return tmp_path / "ckpt"


def rewrite_manifest(step_dir: Path, change: Any) -> None:
    raw = json.loads((step_dir / MANIFEST).read_text())
    change(raw)
    (step_dir / MANIFEST).write_text(json.dumps(raw))


def recheck(step_dir: Path, raw: dict[str, Any], name: str) -> None:
    """Make the manifest's size and crc32c of `name` match the file again (a crafted, not a torn, file)."""
    data = (step_dir / name).read_bytes()
    raw["files"][name] = {"bytes": len(data), "crc32c": crc32c.crc32c(data)}


@pytest.mark.parametrize("name", ["/dev/zero", "../../etc/passwd", "..", "/etc/passwd", "sub/trainer.pt"])
def test_a_manifest_naming_a_file_outside_its_directory_is_refused(two_checkpoints: Path, name: str) -> None:
    step_dir = two_checkpoints / "step_00000004"
    rewrite_manifest(step_dir, lambda raw: raw["files"].update({name: {"bytes": 2**62, "crc32c": 1}}))
    store = CheckpointStore(two_checkpoints)
    with pytest.raises(CorruptCheckpoint, match="not a plain file name"):
        store.verify(Candidate(step_dir.name, 4, step_dir))


@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_a_state_file_that_is_not_a_regular_file_is_refused_without_blocking(two_checkpoints: Path, kind: str) -> None:
    step_dir = two_checkpoints / "step_00000004"
    (step_dir / TRAINER_FILE).unlink()
    if kind == "device":
        (step_dir / TRAINER_FILE).symlink_to("/dev/zero")
    else:
        os.mkfifo(step_dir / TRAINER_FILE)  # opening it for reading would wait for a writer forever
    store = CheckpointStore(two_checkpoints)
    with pytest.raises(CorruptCheckpoint, match="not a regular file"):
        store.verify(Candidate(step_dir.name, 4, step_dir))
    with pytest.raises(CorruptCheckpoint, match="not a regular file"):
        store.read_file(Candidate(step_dir.name, 4, step_dir), TRAINER_FILE, {"bytes": 1, "crc32c": 0})


def huge_chunk(step_dir: Path) -> None:
    """Declare a chunk of 2**40 bytes (sizes to match) in tensors.json, checksums made to pass."""
    tensors = json.loads((step_dir / sharded.TENSORS_FILE).read_text())
    chunk = next(c for c in tensors["chunks"] if c["fqn"] == "model/0.weight")
    rows = 2**40 // 4 // chunk["sizes"][1]
    chunk.update(length=rows * chunk["sizes"][1] * 4, crc32c=[0] * math.ceil(rows * chunk["sizes"][1] * 4 / chunk["block"]))
    chunk["sizes"][0] = rows
    tensors["tensors"]["model/0.weight"]["size"][0] = rows
    tensors["tensors"]["model/0.weight"]["chunks"][0]["sizes"][0] = rows
    (step_dir / sharded.TENSORS_FILE).write_text(json.dumps(tensors))
    rewrite_manifest(step_dir, lambda raw: recheck(step_dir, raw, sharded.TENSORS_FILE))


def test_a_huge_declared_length_falls_back_to_the_older_checkpoint(two_checkpoints: Path, caplog) -> None:
    huge_chunk(two_checkpoints / "step_00000004")
    with caplog.at_level(logging.WARNING):
        name, step, _ = load_newest_model_state(two_checkpoints)
    assert (name, step) == ("step_00000002", 2)
    assert "beyond the files of its checkpoint" in caplog.text


def test_a_restore_falls_back_from_a_crafted_checkpoint_to_the_older_one(two_checkpoints: Path, caplog) -> None:
    huge_chunk(two_checkpoints / "step_00000004")
    again = Job(two_checkpoints)
    with caplog.at_level(logging.WARNING):
        assert again.ckpt.restore() == 2
    again.ckpt.close()
    assert "step_00000004 is corrupt" in caplog.text


def test_a_latest_pointer_that_is_not_a_small_file_is_ignored(two_checkpoints: Path) -> None:
    (two_checkpoints / "latest").unlink()
    os.mkfifo(two_checkpoints / "latest")
    store = CheckpointStore(two_checkpoints)
    assert [c.step for c in store.committed()] == [4, 2]
    (two_checkpoints / "latest").unlink()
    (two_checkpoints / "latest").write_bytes(b"\xff\xfe" * 1000)
    assert store.latest_pointer() is None and [c.step for c in store.committed()] == [4, 2]


def test_a_manifest_of_another_shape_is_one_corrupt_line(two_checkpoints: Path) -> None:
    step_dir = two_checkpoints / "step_00000004"
    rewrite_manifest(step_dir, lambda raw: raw.update(step=[], world_size=True))
    with pytest.raises(CorruptCheckpoint, match="step_00000004: manifest.json's step is \\[\\], not an integer"):
        CheckpointStore(two_checkpoints).verify(Candidate(step_dir.name, 4, step_dir))


def _trainer_of(step_dir: Path) -> dict[str, Any]:
    return torch.load(step_dir / TRAINER_FILE, weights_only=True)


@pytest.mark.parametrize("change", [
    lambda t: [1, 2], lambda t: {"step": 4}, lambda t: {**t, "sampler": []}, lambda t: {**t, "optimizer": 3},
    lambda t: {**t, "rng": "x"}, lambda t: {k: v for k, v in t.items() if k != "rng"}, lambda t: {**t, "rng": []},
    lambda t: {**t, "rng": [{**t["rng"][0], "python": {}}]}, lambda t: {**t, "rng": [t["rng"][0], 5]},
    lambda t: {**t, "sampler": {**t["sampler"], "consumed": -1}}, lambda t: {**t, "scheduler": [1]},
])
def test_a_trainer_state_of_another_shape_falls_back_to_the_older_checkpoint(
    two_checkpoints: Path, change: Any, caplog: pytest.LogCaptureFixture
) -> None:
    step_dir = two_checkpoints / "step_00000004"
    buffer = io.BytesIO()
    torch.save(change(_trainer_of(step_dir)), buffer)  # loads with weights_only=True, its checksum made to pass
    (step_dir / TRAINER_FILE).write_bytes(buffer.getvalue())
    rewrite_manifest(step_dir, lambda raw: recheck(step_dir, raw, TRAINER_FILE))
    again = Job(two_checkpoints)
    with caplog.at_level(logging.WARNING):
        assert again.ckpt.restore() == 2
    again.ckpt.close()
    assert "step_00000004 is corrupt" in caplog.text


def test_of_two_timelines_at_the_same_step_the_one_written_last_is_offered_first() -> None:
    """The partition scenario (a suite run): round 0 (world 2) snapshotted step 18 on a host then cut
    off; round 1 trained steps 16-18 alone (world 1) and snapshotted its own step 18 later. Round 2 took
    round 0's (the larger world won the tie), dropping round 1's steps: their samples read as trained twice."""
    from elastic._worker.checkpoint.memory_source import newest_first

    doc, _ = part_doc()

    def header(world_size: int, created: float) -> parts.PartHeader:
        return parts.PartHeader.from_json(json.dumps({**doc, "step": 18, "world_size": world_size, "created": created}))

    dead, live, older = (18, 2, "round0"), (18, 1, "round1"), (15, 2, "round0")
    headers = {dead: {0: header(2, 100.0), 1: header(2, 100.5)}, live: {0: header(1, 104.0)}, older: {0: header(2, 90.0)}}
    assert newest_first([older, dead, live], headers) == [live, dead, older]
