"""What benchmarks/hf_resume.py's two Trainer scripts share: the model, the data, the TrainingArguments,
and a log of the samples each rank trains on at each step (the benchmark's audit).

Both scripts are stock `Trainer` scripts otherwise; they differ only where the
port to the runtime differs (`hf_resume_elastic.py` vs `hf_resume_stock.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

import torch  # noqa: E402
import transformers  # noqa: E402
from hf_model import ByteWindows, byte_lm  # noqa: E402
from text_data import load_corpus, split_corpus  # noqa: E402

LOG_ENV = "HF_RESUME_SAMPLE_LOG"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


class NumberedWindows(ByteWindows):
    """The recipe's windows, each carrying its index so the audit sees which sample was trained."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {**super().__getitem__(index), "sample_id": torch.tensor(int(index))}


def model_and_data(args: argparse.Namespace) -> tuple[torch.nn.Module, NumberedWindows]:
    train, _ = split_corpus(load_corpus(args.data), block_size=32, val_fraction=0.01)
    transformers.set_seed(args.seed)
    return byte_lm(n_layer=2, n_head=2, n_embd=32, block_size=32, dropout=0.1), NumberedWindows(train)


def training_arguments(args: argparse.Namespace) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, save_steps=args.save_steps, seed=args.seed,
        per_device_train_batch_size=args.batch_size, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=2,
        logging_steps=10, report_to="none", use_cpu=True, remove_unused_columns=False, dataloader_num_workers=0,
        save_only_model=False, disable_tqdm=True,
    )


def logged(trainer_class: type) -> type:
    """`trainer_class` whose training_step appends (time, rank, world size, the launcher's restart count, step,
    sample ids) to $HF_RESUME_SAMPLE_LOG.rankR."""

    class Logged(trainer_class):  # type: ignore[misc, valid-type]
        def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], *rest: Any, **kwargs: Any) -> torch.Tensor:
            ids = inputs.pop("sample_id")
            rank = int(os.environ.get("RANK", "0"))
            record = {"time": time.time(), "rank": rank, "world": int(os.environ.get("WORLD_SIZE", "1")),
                      "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                      "step": self.state.global_step + 1, "samples": ids.tolist()}
            with open(f"{os.environ[LOG_ENV]}.rank{rank}", "a") as log:
                log.write(json.dumps(record) + "\n")
            return super().training_step(model, inputs, *rest, **kwargs)

    return Logged
