"""Train a byte-level causal LM with the Hugging Face `Trainer`, elastically, under torchrun or alone.

One process, on the default data (the Python stdlib's sources):

    python recipes/hf_trainer.py --max-steps 200

An elastic job of 1 to 4 nodes (the same line on every node), as for the GPT recipe:

    torchrevive-run --nnodes=1:4 --nproc-per-node=1 --rdzv-endpoint=HOST:29400 --rdzv-id=job1 \\
        recipes/hf_trainer.py --ckpt-dir ckpt --events runs/job1.jsonl

The script is a stock `Trainer` script with one changed import: `elastic.hf.Trainer`
restores the newest good checkpoint by itself, takes each step's samples from
the elastic sampler, saves asynchronously every `save_steps` (--ckpt-every) and
commits on SIGTERM (docs/huggingface.md). At the end `save_model` writes a
normal Hugging Face model folder to --output-dir.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # models beside the recipe

import torch  # noqa: E402
import transformers  # noqa: E402
from hf_model import ByteWindows, add_model_arguments, byte_lm  # noqa: E402
from text_data import load_corpus, split_corpus  # noqa: E402
from torch.utils.data import Subset  # noqa: E402

import elastic  # noqa: E402
from elastic import (  # noqa: E402
    OneLineArgumentParser,
    UsageError,
    configure_logging,
    positive_float,
    positive_int,
    run_main,
)
from elastic.hf import Trainer  # noqa: E402

logger = logging.getLogger("hf_trainer")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="hf_trainer.py", description="Train a byte-level causal LM with the Hugging Face Trainer.")
    p.add_argument("--max-steps", type=positive_int, default=300, help="optimizer steps in the whole run")
    p.add_argument("--batch-size", type=positive_int, default=16, help="sequences per rank per step")
    p.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches each step's batch is split into")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="peak learning rate (AdamW)")
    p.add_argument("--data", default=None, help="text file or folder (default: the Python stdlib's sources)")
    p.add_argument("--output-dir", default=None,
                   help="where the final model is saved (default: hf-model/ in --ckpt-dir, else ./hf_trainer_output)")
    elastic.add_runtime_arguments(p, seed=1337)
    add_model_arguments(p)
    return p


def training_arguments(args: argparse.Namespace) -> transformers.TrainingArguments:
    """The recipe's flags as TrainingArguments (save_steps is --ckpt-every: the run saves at those steps)."""
    return transformers.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, seed=args.seed,
        per_device_train_batch_size=args.batch_size // args.grad_accum, gradient_accumulation_steps=args.grad_accum,
        per_device_eval_batch_size=args.batch_size, learning_rate=args.lr, weight_decay=args.weight_decay,
        lr_scheduler_type="cosine",
        warmup_steps=args.warmup_steps if args.warmup_steps is not None else max(1, args.max_steps // 20),
        max_grad_norm=args.grad_clip, bf16=args.bf16,
        use_cpu=args.device == "cpu" or not torch.cuda.is_available(),  # bf16 on a CPU needs it said
        save_strategy="steps" if args.ckpt_every else "no", save_steps=args.ckpt_every or 1,
        eval_strategy="steps" if args.eval_every else "no", eval_steps=args.eval_every or None,
        logging_steps=args.log_every, report_to="none", dataloader_num_workers=0,
        dataloader_pin_memory=torch.cuda.is_available(),
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.output_dir is None:  # next to the checkpoints: a job leaves nothing in its working directory
        args.output_dir = os.path.join(args.ckpt_dir, "hf-model") if args.ckpt_dir else "hf_trainer_output"
    if isinstance(args.ckpt_every, str):  # "2e": the Trainer's save_steps counts steps only
        raise UsageError(f"--ckpt-every {args.ckpt_every}: the Trainer saves every N steps; give a number of steps")
    if args.batch_size % args.grad_accum:
        raise UsageError(f"--batch-size {args.batch_size} does not split into --grad-accum {args.grad_accum} equal micro-batches")
    configure_logging(rank=int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else None)
    train_windows, val_windows = split_corpus(
        load_corpus(args.data), block_size=args.block_size, source=args.data or "the default corpus"
    )
    transformers.set_seed(args.seed)  # the same initial weights on every rank
    model = byte_lm(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
                    dropout=args.dropout)
    try:
        training_args = training_arguments(args)
    except ValueError as exc:  # transformers' own checks of the combination (one line, exit 2)
        raise UsageError(f"TrainingArguments: {' '.join(str(exc).split())}") from None
    trainer = Trainer(
        model=model, args=training_args, train_dataset=ByteWindows(train_windows),
        eval_dataset=Subset(ByteWindows(val_windows), range(min(args.eval_samples, len(val_windows)))),
        run_config=elastic.RunConfig.from_args(args),
    )
    result = trainer.train()
    trainer.save_model()
    if trainer.is_world_process_zero():
        logger.info("done: %d steps, mean loss %.4f; model in %s", result.global_step, result.training_loss, args.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
