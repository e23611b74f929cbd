"""Train a mini GPT on bytes of text, elastically, under torchrun or alone.

One process (CPU or one GPU), on the default data (the Python stdlib's sources):

    python recipes/gpt.py --max-steps 200

An elastic job of 1 to 4 nodes, one worker per node (run the same line on every node):

    torchrun --nnodes=1:4 --nproc-per-node=1 --max-restarts=10 \\
        --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 --rdzv-id=job1 \\
        --rdzv-conf=join_timeout=120,last_call_timeout=2 \\
        recipes/gpt.py --data my_text/ --events runs/job1.jsonl

What it learned: `python recipes/gpt.py --generate "def " --ckpt-dir ckpt` samples
text from the newest checkpoint (the same model flags as the training run);
a run also prints a short sample when it ends.

Data: `--data` is a text file or a folder of them; tokens are bytes, so any
text works. Each step the job takes the next global batch of the elastic
sampler's stream (see elastic/_worker/data/sampler.py), so ranks never share a sample.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # models beside the recipe

from gpt_model import GPT, GPTConfig, configure_optimizer, decode_tokens, encode_text  # noqa: E402
from text_data import TokenWindows, load_corpus, split_corpus  # noqa: E402

import elastic  # noqa: E402
from elastic import (  # noqa: E402
    CheckpointMismatchError,
    OneLineArgumentParser,
    UsageError,
    WarmupCosine,
    all_reduce_mean,
    check_model_state,
    configure_logging,
    load_newest_model_state,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    prefetch_slow_imports,
    run_main,
    unit_interval,
)

logger = logging.getLogger("gpt")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="gpt.py", description="Train a mini GPT on bytes of text.")
    p.add_argument("--max-steps", type=positive_int, default=300, help="optimizer steps in the whole run")
    p.add_argument("--batch-size", type=positive_int, default=16, help="sequences per rank per step")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="peak learning rate (AdamW)")
    p.add_argument("--data", default=None, help="text file or folder (default: the Python stdlib's sources)")
    elastic.add_runtime_arguments(p, seed=1337)  # this recipe's own default
    p.add_argument("--block-size", type=positive_int, default=128, help="context length in bytes")
    p.add_argument("--n-layer", type=positive_int, default=4)
    p.add_argument("--n-head", type=positive_int, default=4)
    p.add_argument("--n-embd", type=positive_int, default=128)
    p.add_argument("--dropout", type=unit_interval, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=non_negative_int, default=None, help="default: 5%% of --max-steps")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final LR as a fraction of --lr")
    p.add_argument("--grad-clip", type=positive_float, default=1.0, help="max global gradient norm")
    p.add_argument("--eval-every", type=non_negative_int, default=100, help="steps between validations (0: off)")
    p.add_argument("--eval-batches", type=positive_int, default=4, help="held-out batches per rank per validation")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--fsdp", action="store_true", help="shard parameters, gradients and optimizer state (FSDP2) instead of DDP")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels (torch.use_deterministic_algorithms; on CUDA cuBLAS's fixed workspace), "
                        "so that a run repeats bit for bit on the same GPU; an op without one warns")
    p.add_argument("--generate", metavar="PROMPT", default=None, help="sample text from the newest checkpoint and exit")
    p.add_argument("--sample-tokens", type=non_negative_int, default=200, help="bytes to sample (0: no sample at the end)")
    p.add_argument("--temperature", type=non_negative_float, default=0.8, help="sampling temperature (0: greedy)")
    return p


def model_config(args: argparse.Namespace) -> GPTConfig:
    try:
        return GPTConfig(
            block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
            n_embd=args.n_embd, dropout=args.dropout,
        )
    except ValueError as exc:
        raise UsageError(f"invalid model shape: {exc}") from None


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: TokenWindows, run: elastic.Run, batch_size: int, batches: int) -> float:
    """Mean loss over the first held-out windows, split across ranks, reduced over ranks."""
    model.eval()
    count = min(len(val), batches * batch_size * run.world_size) // run.world_size * run.world_size  # same forwards on every rank
    mine = torch.arange(run.rank, count, run.world_size)
    total = torch.zeros(2, dtype=torch.float64, device=run.device)  # loss sum, samples
    for chunk in mine.split(batch_size):
        x, y = (t.to(run.device) for t in val.batch(chunk))
        _, loss = model(x, y)
        total += torch.stack([loss.double() * len(chunk), torch.tensor(float(len(chunk)), device=run.device)])
    model.train()
    total = all_reduce_mean(total)
    return (total[0] / total[1]).item()


def sample_text(model: GPT, prompt: str, tokens: int, temperature: float, seed: int) -> str:
    """The prompt and `tokens` sampled bytes; a generator of its own leaves the training streams untouched."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    out = model.generate(
        encode_text(prompt).to(generator.device)[None], tokens, temperature=temperature, generator=generator
    )
    return decode_tokens(out[0])


def train(args: argparse.Namespace, train_set: TokenWindows, val_set: TokenWindows) -> dict:
    """The training loop; returns a summary (final step, last loss, steps/s)."""
    cfg = model_config(args)
    with elastic.Run.from_args(args) as run:
        raw_model = GPT(cfg).to(run.device)
        if args.fsdp:  # sharded before the optimizer is built: it holds the shards
            raw_model = run.fsdp(raw_model, blocks=raw_model.blocks)
        optimizer = configure_optimizer(raw_model, lr=args.lr, weight_decay=args.weight_decay)
        warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.max_steps // 20)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(warmup, args.max_steps, args.min_lr_ratio))
        compiled = torch.compile(raw_model) if args.compile else raw_model
        model = compiled if args.fsdp else run.ddp(compiled)
        run.start(
            model=raw_model, optimizer=optimizer, scheduler=scheduler, data=train_set, batch_size=args.batch_size,
            tokens_per_sample=cfg.block_size,
        )
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if run.device.type == "cuda" else nullcontext()

        def validate() -> None:
            with run.pause():
                val_loss = evaluate(raw_model, val_set, run, args.batch_size, args.eval_batches)
            run.event("eval", val_loss=val_loss)
            run.print(f"step {run.step}: validation loss {val_loss:.4f}")

        for indices in run.batches(max_steps=args.max_steps):
            if run.due(args.eval_every):
                validate()
            x, y = (t.to(run.device, non_blocking=True) for t in train_set.batch(indices))
            with autocast:
                _, loss = model(x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            run.log(loss)  # before the update: --numeric-guard reads this step's loss, not only its gradients
            optimizer.step()
            scheduler.step()
        if args.eval_every:
            validate()
        summary = run.finish()
        # After the final checkpoint (the watchdog is off). Sharded, every rank samples alike: forwards are collectives.
        if args.sample_tokens and (run.is_main or args.fsdp):
            text = sample_text(raw_model, "def ", args.sample_tokens, args.temperature, args.seed)
            run.print("sample:\n" + text)
    return summary


def generate(args: argparse.Namespace) -> None:
    """--generate: sample from the newest good checkpoint in --ckpt-dir, alone, without joining a job."""
    if args.ckpt_dir is None:
        raise UsageError("--generate needs --ckpt-dir, the directory of a training run's checkpoints")
    name, step, state = load_newest_model_state(args.ckpt_dir)
    model = GPT(model_config(args))
    try:
        check_model_state(name, model.state_dict(), state)
    except CheckpointMismatchError as exc:
        raise CheckpointMismatchError(f"{exc}; pass the model flags the run was trained with") from None
    model.load_state_dict(state)
    logger.info("sampling from %s (step %d)", name, step)
    print(sample_text(model, args.generate, args.sample_tokens or 200, args.temperature, args.seed))


def use_deterministic_kernels() -> None:
    """--deterministic: before any CUDA work, since cuBLAS reads its workspace setting when it starts.
    A setting the user made wins. CUDA's atomics-based kernels (an embedding's backward, attention's)
    then take their deterministic forms; the few ops that have none warn instead of failing the run."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(rank=int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else None)
    if args.generate is not None:
        generate(args)
        return 0
    if args.deterministic:
        use_deterministic_kernels()
    prefetch_slow_imports()  # overlaps loading data and joining the group
    # Check the data before joining the job: a bad path fails fast, alone, with exit 2.
    corpus = load_corpus(args.data)
    train_set, val_set = split_corpus(corpus, block_size=args.block_size, source=args.data or "the default corpus")
    summary = train(args, train_set, val_set)
    if summary["rank"] == 0:
        logger.info("done: %d steps, final loss %.4f, %.2f steps/s", summary["step"], summary["loss"], summary["steps_per_s"])
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
