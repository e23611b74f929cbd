"""Reading the newest good model weights from a checkpoint directory, in one process."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import torch
from gpt_model import GPT, GPTConfig, configure_optimizer, encode_text
from support import fingerprint

from elastic._shared.common.errors import CheckpointError
from elastic._shared.storage.manifest import Manifest, versions
from elastic._worker.checkpoint import (
    CheckpointManager,
    CheckpointStore,
    load_newest_model_state,
)
from elastic._worker.config import RunConfig
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.runtime.context import init_worker

CFG = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)


class Trainer:
    """A tiny GPT trained step by step, saved through the real CheckpointManager."""

    def __init__(self, ckpt_dir: Path) -> None:
        torch.manual_seed(0)
        self.model = GPT(CFG)
        self.optimizer = configure_optimizer(self.model, lr=1e-2)
        self.sampler = ElasticSampler(64, batch_size=4, seed=1)
        self.ckpt = CheckpointManager(
            init_worker("cpu", environ={}), RunConfig(ckpt_dir=ckpt_dir, ckpt_every=2), model=self.model,
            optimizer=self.optimizer, sampler=self.sampler,
        )

    def run(self, steps: int) -> None:
        for step in range(1, steps + 1):
            idx = torch.randint(0, 256, (4, CFG.block_size + 1))
            _, loss = self.model(idx[:, :-1], idx[:, 1:])
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.sampler.advance(1)
            self.ckpt.maybe_save(step)
        self.ckpt.flush()
        self.ckpt.close()


def flip_a_byte(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0xFF
    path.write_bytes(bytes(data))


def flip_in_tensor(step_dir: Path, prefix: str) -> None:
    """Flip a byte in the middle of the stored bytes of the first tensor whose key starts with
    `prefix` (`model/`: a weight; `optim/`: optimizer state, which loading the model never reads)."""
    chunks = json.loads((step_dir / "tensors.json").read_text())["chunks"]
    chunk = next(c for c in sorted(chunks, key=lambda c: c["fqn"]) if c["fqn"].startswith(prefix) and c["length"] > 1)
    flip_a_byte(step_dir / chunk["file"], chunk["offset"] + chunk["length"] // 2)


def damage(step_dir: Path, what: str) -> None:
    if what in ("model/", "optim/"):
        flip_in_tensor(step_dir, what)
    else:
        flip_a_byte(step_dir / what)


@pytest.fixture
def trained(tmp_path: Path) -> tuple[Path, GPT]:
    """Checkpoints at steps 2, 4 and 6, and the model as it was at step 6."""
    trainer = Trainer(tmp_path / "ckpt")
    trainer.run(6)
    return tmp_path / "ckpt", trainer.model


def test_the_newest_checkpoint_is_read(trained: tuple[Path, GPT]) -> None:
    ckpt_dir, model = trained
    name, step, state = load_newest_model_state(ckpt_dir)
    assert (name, step) == ("step_00000006", 6)
    assert state.keys() == model.state_dict().keys()
    assert all(t.device.type == "cpu" for t in state.values())


def test_the_weights_load_into_a_fresh_gpt_and_give_the_same_logits(trained: tuple[Path, GPT]) -> None:
    ckpt_dir, model = trained
    _, _, state = load_newest_model_state(ckpt_dir)
    torch.manual_seed(99)  # a different initialisation, so equality means the load worked
    fresh = GPT(CFG)
    fresh.load_state_dict(state)
    assert fresh.head.weight is fresh.tok_emb.weight, "loading keeps the tied weight tied"
    idx = encode_text("def main():\n    ")[None]
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(idx)[0], model.eval()(idx)[0], rtol=0, atol=0)


@pytest.mark.parametrize("damaged", ["model/", "optim/", "tensors.json", "trainer.pt", "manifest.json"])
def test_a_corrupt_newest_falls_back_and_is_left_in_place(
    trained: tuple[Path, GPT], damaged: str, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt_dir, _ = trained
    damage(ckpt_dir / "step_00000006", damaged)
    before = fingerprint(ckpt_dir)
    with caplog.at_level(logging.WARNING, logger="elastic._worker.checkpoint.reader"):
        name, step, _ = load_newest_model_state(ckpt_dir)
    assert (name, step) == ("step_00000004", 4)
    assert "step_00000006 is corrupt" in caplog.text
    assert fingerprint(ckpt_dir) == before, "read only: nothing moved, deleted or written"
    assert not list(ckpt_dir.glob("*.corrupt"))


def test_the_latest_pointer_is_not_trusted(trained: tuple[Path, GPT]) -> None:
    ckpt_dir, _ = trained
    (ckpt_dir / "latest").write_text("step_00000002\n")
    assert load_newest_model_state(ckpt_dir)[:2] == ("step_00000006", 6)


def test_a_missing_directory_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist") as info:
        load_newest_model_state(tmp_path / "nowhere")
    assert "\n" not in str(info.value)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is not a directory"):
        load_newest_model_state(tmp_path / "file")


def test_a_directory_without_checkpoints_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / ".tmp.step_00000009.abcd").mkdir()  # a save that never committed does not count
    with pytest.raises(CheckpointError, match="holds no committed checkpoint"):
        load_newest_model_state(tmp_path)


def test_all_corrupt_is_one_clear_error_and_nothing_is_touched(trained: tuple[Path, GPT]) -> None:
    ckpt_dir, _ = trained
    for step in (2, 4, 6):
        flip_in_tensor(ckpt_dir / f"step_{step:08d}", "model/")
    before = fingerprint(ckpt_dir)
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* verifies \(3 corrupt, newest: step_00000006") as info:
        load_newest_model_state(ckpt_dir)
    assert "\n" not in str(info.value)
    assert fingerprint(ckpt_dir) == before


def describe(step: int):
    def build(files):
        return Manifest(
            step=step, epoch=0, consumed=0, world_size=1, files=files, created=time.time(),
            reason="periodic", run_id="test", versions=versions(),
        )
    return build


class Planted:
    """An object whose unpickling would run code: it must never run."""

    ran = False

    def __reduce__(self):
        return (Planted._run, ())

    @staticmethod
    def _run() -> Planted:
        Planted.ran = True
        return Planted()


def test_pickled_code_in_a_model_file_never_runs(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.commit(1, {"model.pt": {"w": torch.ones(2)}}, describe=describe(1))
    store.commit(2, {"model.pt": {"w": torch.zeros(2), "x": Planted()}}, describe=describe(2))
    name, step, state = load_newest_model_state(tmp_path)
    assert (name, step) == ("step_00000001", 1) and torch.equal(state["w"], torch.ones(2))
    assert not Planted.ran


def test_only_the_model_file_is_deserialized(tmp_path: Path) -> None:
    """A verified optimizer file is hashed, never unpickled: not even weights_only looks at it."""
    store = CheckpointStore(tmp_path)
    store.commit(
        3, {"model.pt": {"w": torch.ones(2)}, "optimizer.pt": {"x": Planted()}}, describe=describe(3)
    )
    assert load_newest_model_state(tmp_path)[:2] == ("step_00000003", 3)
    assert not Planted.ran


def test_a_checkpoint_without_model_weights_is_skipped(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.commit(1, {"model.pt": {"w": torch.ones(2)}}, describe=describe(1))
    store.commit(2, {"trainer.pt": {"step": 2}}, describe=describe(2))
    store.commit(3, {"model.pt": [torch.ones(2)]}, describe=describe(3))
    assert load_newest_model_state(tmp_path)[:2] == ("step_00000001", 1)
