"""elastic.hf.Trainer in one process: a run stopped part way and trained on from its checkpoint ends
bit-identical to one never stopped (model, optimizer, scheduler, data position, dropout's RNG), with
gradient accumulation; the Trainer's callbacks, logs and save_model still work."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
import transformers  # noqa: E402
from support import REPO, make_text  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from elastic._worker.checkpoint import read_checkpoint  # noqa: E402
from elastic._worker.config import RunConfig  # noqa: E402
from elastic.hf import Trainer  # noqa: E402

sys.path.insert(0, str(REPO / "recipes"))
from hf_model import ByteWindows, byte_lm  # noqa: E402
from text_data import split_corpus  # noqa: E402

STEPS = 10


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def train(workdir: Path, *, stop_at: int | None = None, **settings) -> Trainer:
    train_windows, val_windows = split_corpus(make_text(random.Random(5), 8_000).encode(), block_size=16)
    transformers.set_seed(11)
    model = byte_lm(n_layer=1, n_head=2, n_embd=16, block_size=16, dropout=0.2)
    settings = {
        "learning_rate": 3e-3, "lr_scheduler_type": "cosine", "warmup_steps": 2, "eval_strategy": "steps",
        "eval_steps": 3, **settings,
    }
    args = transformers.TrainingArguments(
        output_dir=str(workdir / "out"), max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        save_steps=3, logging_steps=2, seed=11, report_to="none", use_cpu=True, per_device_eval_batch_size=8,
        **settings,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=ByteWindows(train_windows), eval_dataset=ByteWindows(val_windows),
        callbacks=[StopAt(stop_at)] if stop_at else None,
        run_config=RunConfig(events=str(workdir / "events.jsonl"), hang_timeout=0),
    )
    trainer.train()
    return trainer


def final_tensors(workdir: Path) -> dict[str, torch.Tensor]:
    ckpt = workdir / "out" / "elastic-checkpoints"
    return read_checkpoint(ckpt / (ckpt / "latest").read_text().strip())[1]


def test_a_stopped_run_trained_on_ends_bit_identical_to_one_never_stopped(tmp_path: Path) -> None:
    whole = train(tmp_path / "whole")
    assert whole.state.global_step == STEPS
    train(tmp_path / "parts", stop_at=4)
    resumed = train(tmp_path / "parts")
    assert resumed.state.global_step == STEPS
    want, got = final_tensors(tmp_path / "whole"), final_tensors(tmp_path / "parts")
    assert want.keys() == got.keys() and any(k.startswith("optim/") for k in want)
    different = [k for k in want if not torch.equal(want[k], got[k])]
    assert not different, different[:3]
    starts = [json.loads(line) for line in (tmp_path / "parts" / "events.jsonl").read_text().splitlines()]
    assert [r["step"] for r in starts if r["event"] == "start"] == [0, 4]


def test_the_trainers_logs_callbacks_and_save_model_still_work(tmp_path: Path) -> None:
    trainer = train(tmp_path)
    losses = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in losses] == [2, 4, 6, 8, 10]
    assert all(entry["loss"] > 0 and "learning_rate" in entry and "grad_norm" in entry for entry in losses)
    # Evaluated between steps, after the step it was due at: 3, 6, 9 and the last.
    assert [entry["step"] for entry in trainer.state.log_history if "eval_loss" in entry] == [3, 6, 9, 10]
    trainer.save_model()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), trainer.model.state_dict().values()))
    events = [json.loads(line)["event"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events.count("step") == STEPS and events[-1] == "end"


def test_a_plateau_schedule_steps_on_the_evaluation_and_the_best_metric_is_kept(tmp_path: Path) -> None:
    trainer = train(tmp_path, lr_scheduler_type="reduce_lr_on_plateau", metric_for_best_model="loss",
                    greater_is_better=False)
    assert isinstance(trainer.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    evals = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
    assert trainer.state.best_metric == min(evals)


def test_an_optimizer_given_to_the_trainer_is_the_one_trained_and_saved(tmp_path: Path) -> None:
    train_windows, _ = split_corpus(make_text(random.Random(5), 4_000).encode(), block_size=16)
    model = byte_lm(n_layer=1, n_head=2, n_embd=16, block_size=16, dropout=0.0)
    mine = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=2,
                                          report_to="none", use_cpu=True, save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=ByteWindows(train_windows), optimizers=(mine, None))
    trainer.train()
    assert trainer.optimizer is mine
    state = final_tensors(tmp_path)
    assert any(k.startswith("optim/") and "momentum_buffer" in k for k in state), sorted(state)[:5]
