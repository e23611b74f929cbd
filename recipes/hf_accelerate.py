"""Train the Hugging Face recipe's byte-level causal LM with `accelerate`, elastically.

One process, on the default data (the Python stdlib's sources):

    python recipes/hf_accelerate.py --max-steps 200

An elastic job (the same line on every node):

    torchrevive-run --nnodes=1:4 --nproc-per-node=1 --rdzv-endpoint=HOST:29400 --rdzv-id=job1 \\
        recipes/hf_accelerate.py --ckpt-dir ckpt --events runs/job1.jsonl

The usual accelerate loop (prepare, backward, step) inside `elastic.Run`:
`elastic._worker.hf.start_accelerated` registers what accelerate prepared and restores
the newest good checkpoint, and the train loader is driven by the run's step
sampler. --fsdp shards the model with accelerate's FSDP2 plugin.
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
from accelerate import Accelerator, FullyShardedDataParallelPlugin  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402
from hf_model import ByteWindows, add_model_arguments, byte_lm  # noqa: E402
from text_data import load_corpus, split_corpus  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import elastic  # noqa: E402
from elastic import (  # noqa: E402
    OneLineArgumentParser,
    UsageError,
    all_reduce_mean,
    configure_logging,
    positive_float,
    positive_int,
    run_main,
)
from elastic.hf import start_accelerated  # noqa: E402

logger = logging.getLogger("hf_accelerate")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="hf_accelerate.py", description="Train a byte-level causal LM with accelerate.")
    p.add_argument("--max-steps", type=positive_int, default=300, help="optimizer steps in the whole run")
    p.add_argument("--batch-size", type=positive_int, default=16, help="sequences per rank per step")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="peak learning rate (AdamW)")
    p.add_argument("--data", default=None, help="text file or folder (default: the Python stdlib's sources)")
    p.add_argument("--output-dir", default=None,
                   help="where the final model is saved (default: hf-model/ in --ckpt-dir, else ./hf_accelerate_output)")
    elastic.add_runtime_arguments(p, seed=1337)
    add_model_arguments(p)
    p.add_argument("--fsdp", action="store_true", help="shard the model with accelerate's FSDP2 plugin instead of DDP")
    return p


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: ByteWindows, run: elastic.Run, accelerator: Accelerator, samples: int, batch_size: int) -> float:
    """Mean loss over the first held-out windows, split across ranks, averaged over ranks."""
    model.eval()
    count = min(len(val), samples) // run.world_size * run.world_size or run.world_size
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for chunk in torch.arange(run.rank, count, run.world_size).split(batch_size):
        ids = torch.stack([val[int(i) % len(val)]["input_ids"] for i in chunk]).to(accelerator.device)
        with accelerator.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        total += torch.stack([loss.double() * len(chunk), torch.tensor(float(len(chunk)), device=accelerator.device)])
    model.train()
    total = all_reduce_mean(total)
    return (total[0] / total[1]).item()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.output_dir is None:  # next to the checkpoints: a job leaves nothing in its working directory
        args.output_dir = os.path.join(args.ckpt_dir, "hf-model") if args.ckpt_dir else "hf_accelerate_output"
    configure_logging(rank=int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else None)
    train_windows, val_windows = split_corpus(
        load_corpus(args.data), block_size=args.block_size, source=args.data or "the default corpus"
    )
    train_set, val_set = ByteWindows(train_windows), ByteWindows(val_windows)
    with elastic.Run.from_args(args) as run:
        accelerator = Accelerator(
            cpu=run.device.type == "cpu", mixed_precision="bf16" if args.bf16 else "no",
            fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2) if args.fsdp else None,
        )
        if args.fsdp and accelerator.distributed_type != DistributedType.FSDP:
            raise UsageError(
                "--fsdp: accelerate shards with FSDP on GPUs only (here it would train unsharded); drop --fsdp, "
                "or run on GPUs"
            )
        model = byte_lm(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
                        dropout=args.dropout)
        model = accelerator.prepare(model)  # DDP or FSDP2; the optimizer is built on what it holds after
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        optimizer = accelerator.prepare(optimizer)
        warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.max_steps // 20)
        scheduler = transformers.get_cosine_schedule_with_warmup(optimizer.optimizer, warmup, args.max_steps)
        start_accelerated(run, accelerator, model=model, optimizer=optimizer, scheduler=scheduler, data=train_set,
                          batch_size=args.batch_size, tokens_per_sample=args.block_size + 1)
        loader = DataLoader(train_set, batch_sampler=run.batch_sampler())
        for batch in run.batches(loader, max_steps=args.max_steps):
            if run.due(args.eval_every):
                with run.pause():
                    val_loss = evaluate(model, val_set, run, accelerator, args.eval_samples, args.batch_size)
                run.event("eval", val_loss=val_loss)
                run.print(f"step {run.step}: validation loss {val_loss:.4f}")
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            with accelerator.autocast():
                loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            run.log(loss)
        summary = run.finish()
        accelerator.wait_for_everyone()
        state = accelerator.get_state_dict(model)  # gathered from the shards under FSDP2 (a collective)
        if run.is_main:
            accelerator.unwrap_model(model).save_pretrained(args.output_dir, state_dict=state)
            logger.info("done: %d steps, final loss %.4f; model in %s", summary["step"], summary["loss"], args.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
