"""elastic.hf: what it refuses at start (one line, exit 2, nothing started), how it maps
TrainingArguments to the run's settings, and how it splits a step's batch."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
import transformers  # noqa: E402
from support import REPO, make_text  # noqa: E402
from torch.utils.data import IterableDataset  # noqa: E402

from elastic._shared.common.errors import UsageError  # noqa: E402
from elastic._worker.config import RunConfig  # noqa: E402
from elastic._worker.hf.checks import check_accelerator  # noqa: E402
from elastic._worker.hf.trainer import Trainer, run_config_for, split_batch  # noqa: E402

sys.path.insert(0, str(REPO / "recipes"))
from hf_model import ByteWindows, byte_lm  # noqa: E402
from text_data import split_corpus  # noqa: E402


@pytest.fixture(scope="module")
def windows() -> ByteWindows:
    train, _ = split_corpus(make_text(random.Random(3), 6_000).encode(), block_size=16)
    return ByteWindows(train)


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return byte_lm(n_layer=1, n_head=2, n_embd=16, block_size=16, dropout=0.1)


def arguments(tmp_path: Path, **settings) -> transformers.TrainingArguments:
    settings = {"max_steps": 4, "report_to": "none", "use_cpu": True, "per_device_train_batch_size": 4, **settings}
    return transformers.TrainingArguments(output_dir=str(tmp_path / "out"), **settings)


@pytest.fixture(autouse=True)
def transformers_quiet():
    """transformers' own warnings (torch_compile's "speedups ... GPU Ampere") are not the refusal
    under test. Its log handler holds the sys.stderr of the moment transformers first configured
    it; when that was an earlier test's capsys stream, now closed, each warning prints a
    "--- Logging error ---" traceback into this test's stderr. Errors only, while a test runs."""
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(level)


class Stream(IterableDataset):
    def __iter__(self):
        yield {"input_ids": torch.zeros(4, dtype=torch.long)}


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"max_steps": -1, "num_train_epochs": 2}, "max_steps=N"),
        ({"train_sampling_strategy": "group_by_length"}, "group_by_length"),
        ({"train_sampling_strategy": "sequential"}, "sequential"),
        ({"auto_find_batch_size": True}, "auto_find_batch_size"),
        ({"torch_compile": True}, "torch_compile"),
        ({"gradient_checkpointing": True}, "gradient_checkpointing_enable"),
        ({"neftune_noise_alpha": 5.0}, "neftune_noise_alpha"),
        ({"data_seed": 3}, "data_seed"),
        ({"eval_on_start": True, "eval_strategy": "steps", "eval_steps": 2}, "eval_on_start"),
        ({"fp16": True}, "fp16"),
        ({"save_strategy": "epoch"}, "save_strategy='epoch'"),
        ({"eval_strategy": "epoch"}, "eval_strategy='epoch'"),
        ({"logging_strategy": "epoch"}, "logging_strategy='epoch'"),
    ],
)
def test_a_feature_it_cannot_keep_exact_is_refused_in_one_line(
    settings: dict, named: str, tmp_path: Path, windows: ByteWindows, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        Trainer(model=tiny_model(), args=arguments(tmp_path, **settings), train_dataset=windows)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0] and "elastic.hf.Trainer" in err[0], err
    assert not (tmp_path / "out").exists()


def test_deepspeed_is_refused_before_deepspeed_is_imported(
    tmp_path: Path, windows: ByteWindows, capsys: pytest.CaptureFixture[str]
) -> None:
    # TrainingArguments(deepspeed=...) itself needs the deepspeed package, which this machine lacks: the
    # config is set afterwards, as it stands once that package is installed.
    args = arguments(tmp_path)
    args.deepspeed = {"zero_optimization": {"stage": 2}}
    with pytest.raises(SystemExit) as exit_:
        Trainer(model=tiny_model(), args=args, train_dataset=windows)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "DeepSpeed" in err and "\n" not in err


def test_an_iterable_data_set_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        Trainer(model=tiny_model(), args=arguments(tmp_path), train_dataset=Stream())
    assert "iterable data set" in capsys.readouterr().err


def test_resuming_from_a_hugging_face_checkpoint_path_is_refused(
    tmp_path: Path, windows: ByteWindows, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer = Trainer(model=tiny_model(), args=arguments(tmp_path), train_dataset=windows)
    with pytest.raises(SystemExit) as exit_:
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert exit_.value.code == 2 and "drop the argument" in capsys.readouterr().err
    assert not (tmp_path / "out" / "elastic-checkpoints").exists()


def test_training_arguments_become_the_run_settings(tmp_path: Path) -> None:
    args = arguments(tmp_path, max_steps=200, save_steps=0.1, seed=7)
    config = run_config_for(args, RunConfig(events=str(tmp_path / "ev.jsonl"), ckpt_every=999))
    assert (config.seed, config.ckpt_every, config.device) == (7, 20, "cpu")
    assert config.ckpt_dir == str(tmp_path / "out" / "elastic-checkpoints") and config.events.endswith("ev.jsonl")
    assert run_config_for(arguments(tmp_path, save_strategy="no")).ckpt_every == 0
    given = run_config_for(arguments(tmp_path, save_steps=5), RunConfig(ckpt_dir=str(tmp_path / "mine")))
    assert (given.ckpt_dir, given.ckpt_every) == (str(tmp_path / "mine"), 5)


def test_a_step_batch_splits_into_equal_micro_batches() -> None:
    batch = {"input_ids": torch.arange(12).view(6, 2), "names": list("abcdef"), "scale": 2.0}
    parts = split_batch(batch, 3)
    assert [p["input_ids"].tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]]]
    assert [p["names"] for p in parts] == [["a", "b"], ["c", "d"], ["e", "f"]]
    assert all(p["scale"] == 2.0 for p in parts)
    assert split_batch(batch, 1) == [batch]
    with pytest.raises(UsageError, match="dict-like"):
        split_batch(torch.zeros(4), 2)


def test_accelerator_settings_whose_steps_are_not_the_runs_are_refused() -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    try:
        with pytest.raises(UsageError, match="gradient_accumulation_steps=2"):
            check_accelerator(Accelerator(cpu=True, gradient_accumulation_steps=2), None)
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        accelerator = Accelerator(cpu=True)
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
        _, prepared = accelerator.prepare(optimizer, scheduler)
        with pytest.raises(UsageError, match="once per process"):
            check_accelerator(accelerator, prepared)
        check_accelerator(accelerator, scheduler)  # unprepared: stepped once per step by the script
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_the_ported_stock_trainer_script_differs_in_at_most_5_lines() -> None:
    import difflib

    stock = (REPO / "benchmarks" / "hf_resume_stock.py").read_text().splitlines()
    ported = (REPO / "benchmarks" / "hf_resume_elastic.py").read_text().splitlines()
    diff = [line for line in difflib.unified_diff(stock, ported, lineterm="", n=0) if not line.startswith(("---", "+++", "@@"))]
    removed, added = sum(line.startswith("-") for line in diff), sum(line.startswith("+") for line in diff)
    assert max(removed, added) <= 5, diff
    assert "+from elastic.hf import Trainer" in diff and "from transformers import Trainer" in "\n".join(stock)


def test_a_process_outside_a_launched_job_joins_no_group() -> None:
    from elastic._worker.hf.group import join_before_accelerate

    assert join_before_accelerate({}) is False
    assert join_before_accelerate({"RANK": "0", "WORLD_SIZE": "2"}) is False  # no rendezvous address: not launched
