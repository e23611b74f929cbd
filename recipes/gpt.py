"""Train a mini GPT on bytes of text, elastically, under torchrun or alone.

One process (CPU or one GPU), on the default data (the Python stdlib's sources):

    python recipes/gpt.py --max-steps 200

An elastic job of 1 to 4 nodes, one worker per node (run the same line on every node):

    torchrun --nnodes=1:4 --nproc-per-node=1 --max-restarts=10 \\
        --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 --rdzv-id=job1 \\
        --rdzv-conf=join_timeout=120,last_call_timeout=2 \\
        recipes/gpt.py --data my_text/ --events runs/job1.jsonl

Data: `--data` is a text file or a folder of them; tokens are bytes, so any
text works. Each step the job takes the next global batch of the elastic
sampler's stream (see elastic/sampler.py), so ranks never share a sample.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))  # models beside the recipe

from gpt_model import GPT, GPTConfig, configure_optimizer  # noqa: E402
from text_data import TokenWindows, load_corpus, split_corpus  # noqa: E402

from elastic.chaos import FaultInjector  # noqa: E402
from elastic.checkpoint import CheckpointManager  # noqa: E402
from elastic.cli import (  # noqa: E402
    OneLineArgumentParser,
    configure_logging,
    non_negative_int,
    positive_float,
    positive_int,
    run_main,
    unit_interval,
)
from elastic.contract import add_runtime_arguments  # noqa: E402
from elastic.errors import ElasticError, UsageError  # noqa: E402
from elastic.events import EventLog  # noqa: E402
from elastic.metrics import start_metrics  # noqa: E402
from elastic.preemption import PreemptionHandler, commit_and_stop  # noqa: E402
from elastic.progress import Progress  # noqa: E402
from elastic.replicas import gather_digests, parameter_digest  # noqa: E402
from elastic.rng import seed_all  # noqa: E402
from elastic.runtime import (  # noqa: E402
    WorkerContext,
    all_reduce_mean,
    prefetch_slow_imports,
    worker_context,
)
from elastic.sampler import ElasticSampler  # noqa: E402
from elastic.schedules import WarmupCosine  # noqa: E402
from elastic.watchdog import watchdog  # noqa: E402

logger = logging.getLogger("gpt")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="gpt.py", description="Train a mini GPT on bytes of text.")
    p.add_argument("--max-steps", type=positive_int, default=300, help="optimizer steps in the whole run")
    p.add_argument("--batch-size", type=positive_int, default=16, help="sequences per rank per step")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="peak learning rate (AdamW)")
    p.add_argument("--seed", type=non_negative_int, default=1337)
    p.add_argument("--data", default=None, help="text file or folder (default: the Python stdlib's sources)")
    add_runtime_arguments(p, ckpt_every=50)
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
    p.add_argument("--log-every", type=positive_int, default=10, help="steps between log lines off a terminal")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    return p


@dataclass
class StepRecord:
    """A finished step whose loss is read later, so the host never waits on the device mid-loop."""

    step: int
    loss: torch.Tensor
    time: float


def model_config(args: argparse.Namespace) -> GPTConfig:
    try:
        return GPTConfig(
            block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
            n_embd=args.n_embd, dropout=args.dropout,
        )
    except ValueError as exc:
        raise UsageError(f"invalid model shape: {exc}") from None


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: TokenWindows, ctx: WorkerContext, batch_size: int, batches: int) -> float:
    """Mean loss over the first held-out windows, split across ranks, reduced over ranks."""
    model.eval()
    count = min(len(val), batches * batch_size * ctx.world_size)
    mine = torch.arange(ctx.rank, count, ctx.world_size)
    total = torch.zeros(2, dtype=torch.float64, device=ctx.device)  # loss sum, samples
    for chunk in mine.split(batch_size):
        x, y = (t.to(ctx.device) for t in val.batch(chunk))
        _, loss = model(x, y)
        total += torch.stack([loss.double() * len(chunk), torch.tensor(float(len(chunk)), device=ctx.device)])
    model.train()
    total = all_reduce_mean(ctx, total)
    return (total[0] / total[1]).item()


def train(args: argparse.Namespace, ctx: WorkerContext, train_set: TokenWindows, val_set: TokenWindows) -> dict:
    """The training loop; returns a summary (final step, last loss, steps/s)."""
    cfg = model_config(args)
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    raw_model = GPT(cfg).to(ctx.device)
    optimizer = configure_optimizer(raw_model, lr=args.lr, weight_decay=args.weight_decay)
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.max_steps // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(warmup, args.max_steps, args.min_lr_ratio)
    )
    model: torch.nn.Module = torch.compile(raw_model) if args.compile else raw_model
    if ctx.distributed:
        model = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    seed_all(args.seed + ctx.rank, ctx.device)  # each rank its own dropout stream
    sampler = ElasticSampler(len(train_set), batch_size=args.batch_size, seed=args.seed)

    with ExitStack() as cleanup:  # on every exit path: commit saves in flight, restore SIGTERM
        events = cleanup.enter_context(EventLog(args.events if ctx.is_main else None, restart=ctx.restart_count))
        hang = watchdog(args.hang_timeout)  # armed by the first completed step
        cleanup.callback(hang.close)
        cleanup.enter_context(  # before restore, so a scrape sees the restore too
            start_metrics(
                ctx, events, port=args.metrics_port, host=args.metrics_host,
                samples_per_step=args.batch_size, tokens_per_sample=cfg.block_size, watchdog=hang,
            )
        )
        ckpt = CheckpointManager(
            ctx, args.ckpt_dir, every=args.ckpt_every, keep=args.ckpt_keep, model=raw_model, optimizer=optimizer,
            scheduler=scheduler, sampler=sampler, events=events, seed=args.seed,
        )
        cleanup.callback(ckpt.close)
        preemption = PreemptionHandler(ctx, grace=args.term_grace)
        cleanup.callback(preemption.uninstall)
        faults = FaultInjector(ctx.rank, ctx.restart_count)  # ELASTIC_FAULT, for chaos tests
        step = ckpt.restore()  # 0 on a fresh start; RNG, sampler and optimizer as they were at `step`
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if ctx.device.type == "cuda" else nullcontext()
        tokens_per_step = args.batch_size * cfg.block_size * ctx.world_size
        progress = Progress(total=args.max_steps, initial=step, enabled=ctx.is_main, log_every=args.log_every)
        events.emit(
            "start", step=step, world_size=ctx.world_size, run_id=ctx.run_id,
            parameters=raw_model.num_parameters(), device=str(ctx.device),
            samples_per_step=args.batch_size * ctx.world_size, tokens_per_step=tokens_per_step,
        )
        if ctx.is_main:
            logger.info(
                "training %.2fM parameters on %d train / %d held-out sequences, world size %d, device %s, from step %d",
                raw_model.num_parameters() / 1e6, len(train_set), len(val_set), ctx.world_size, ctx.device, step,
            )

        last_report = time.time()
        last_loss = math.nan

        def report(record: StepRecord) -> None:
            nonlocal last_report, last_loss
            last_loss = record.loss.item()
            elapsed, last_report = record.time - last_report, record.time
            events.emit("step", step=record.step, world_size=ctx.world_size, time=record.time, loss=last_loss)
            progress.update(record.step, loss=last_loss, tokens_per_s=tokens_per_step / max(elapsed, 1e-9))

        def validate() -> None:
            if args.eval_every == 0:
                return
            val_loss = evaluate(raw_model, val_set, ctx, args.batch_size, args.eval_batches)
            events.emit("eval", step=step, world_size=ctx.world_size, val_loss=val_loss)
            progress.write(f"step {step}: validation loss {val_loss:.4f}")

        pending: StepRecord | None = None
        started, first_step = time.perf_counter(), step
        while step < args.max_steps:
            x, y = train_set.batch(sampler.local_batch(ctx.rank, ctx.world_size))
            x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
            with autocast:
                _, loss = model(x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            scheduler.step()
            sampler.advance(ctx.world_size)
            step += 1
            # Read the previous step's loss only now: the device already has this step queued.
            if pending is not None:
                report(pending)
            pending = StepRecord(step, loss.detach(), time.time())
            if preemption.requested():  # SIGTERM on any rank: commit this step, then leave
                report(pending)
                commit_and_stop(step, ckpt, hang, progress)
            ckpt.maybe_save(step)
            faults.at("after_step", step)
            hang.beat(step)
            if args.eval_every and step % args.eval_every == 0:
                report(pending)
                pending = None
                with hang.paused():
                    validate()
        if pending is not None:
            report(pending)
        seconds = time.perf_counter() - started
        hang.close()  # what follows is not a training step
        if args.eval_every and step % args.eval_every != 0:
            validate()

        ckpt.save(step, reason="final")
        ckpt.flush()
        digests = gather_digests(ctx, parameter_digest(raw_model))
        events.emit("end", step=step, world_size=ctx.world_size, loss=last_loss, param_digests=digests)
        progress.close()
        if len(set(digests)) != 1:
            raise ElasticError(f"ranks ended with different parameters (digests {digests}); the replicas diverged")
        steps_run = step - first_step
        return {"step": step, "loss": last_loss, "steps_per_s": steps_run / seconds if seconds > 0 else math.inf}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prefetch_slow_imports()  # overlaps loading data and joining the group
    configure_logging(rank=int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else None)
    # Check the data before joining the job: a bad path fails fast, alone, with exit 2.
    corpus = load_corpus(args.data)
    source = args.data or "the default corpus"
    train_set, val_set = split_corpus(corpus, block_size=args.block_size, source=source)
    with worker_context(args.device, timeout=timedelta(seconds=args.collective_timeout)) as ctx:
        summary = train(args, ctx, train_set, val_set)
    if ctx.is_main:
        logger.info("done: %d steps, final loss %.4f, %.2f steps/s", summary["step"], summary["loss"], summary["steps_per_s"])
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
