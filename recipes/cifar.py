"""Train a ResNet-18 (or a small CNN) on CIFAR-10, elastically, under torchrun or alone.

The data: the python version of CIFAR-10, extracted so that DIR/cifar-10-batches-py/
exists (nothing is downloaded at run time):

    mkdir -p data && curl -L https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz | tar -xz -C data

One process (CPU or one GPU):

    python recipes/cifar.py --data data --epochs 30

An elastic job of 1 to 4 nodes, two GPUs each (run the same line on every node):

    torchrun --nnodes=1:4 --nproc-per-node=2 --max-restarts=10 \\
        --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 --rdzv-id=cifar1 \\
        --rdzv-conf=join_timeout=120,last_call_timeout=2 \\
        recipes/cifar.py --data data --max-steps 6000 --ckpt-dir ckpt --events runs/cifar1.jsonl

A smoke run without the data set: `python recipes/cifar.py --fake-data --model cnn --max-steps 20`.

Each step the job takes the next global batch of the elastic sampler's stream
(see elastic/sampler.py); DataLoader workers prepare this rank's share of the
steps to come, each image augmented from a seed of (seed, epoch, index) alone,
so a job resumed after a kill ends bit-identical to one never interrupted.
At world size > 1 batch norm uses the statistics of the whole job's batch
(cifar_model.sync_batchnorm), so every rank holds the same running statistics.
Test accuracy is measured at every epoch boundary, on all ranks, each taking
a shard of the test set.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import math
import os
import sys
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # models beside the recipe

from cifar_data import (  # noqa: E402
    SeededAugmentation,
    Transformed,
    eval_transform,
    fake_cifar10,
    load_cifar10,
    step_loader,
    train_transform,
)
from cifar_model import (  # noqa: E402
    MODEL_CHOICES,
    build_model,
    num_parameters,
    parameter_groups,
    sync_batchnorm,
)

from elastic.chaos import FaultInjector  # noqa: E402
from elastic.checkpoint import CheckpointManager  # noqa: E402
from elastic.cli import (  # noqa: E402
    OneLineArgumentParser,
    configure_logging,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    run_main,
    unit_interval,
)
from elastic.contract import add_runtime_arguments  # noqa: E402
from elastic.errors import ElasticError  # noqa: E402
from elastic.events import EventLog  # noqa: E402
from elastic.metrics import start_metrics  # noqa: E402
from elastic.preemption import PreemptionHandler, commit_and_stop  # noqa: E402
from elastic.progress import Progress  # noqa: E402
from elastic.replicas import gather_digests, parameter_digest  # noqa: E402
from elastic.rng import seed_all  # noqa: E402
from elastic.runtime import (  # noqa: E402
    WorkerContext,
    prefetch_slow_imports,
    worker_context,
)
from elastic.sampler import ElasticSampler  # noqa: E402
from elastic.schedules import OneCycle, WarmupCosine  # noqa: E402
from elastic.watchdog import watchdog  # noqa: E402

logger = logging.getLogger("cifar")

DEFAULT_EPOCHS = 30


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="cifar.py", description="Train a ResNet-18 or a small CNN on CIFAR-10.")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--max-steps", type=positive_int, default=None, help="optimizer steps in the whole run")
    length.add_argument(
        "--epochs", type=positive_float, default=None,
        help=f"passes over the training set, turned into steps at the current world size (default {DEFAULT_EPOCHS})",
    )
    p.add_argument("--batch-size", type=positive_int, default=128, help="images per rank per step")
    p.add_argument("--lr", type=positive_float, default=0.1, help="peak learning rate (SGD)")
    p.add_argument("--seed", type=non_negative_int, default=1337)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--data", default=None, help="folder holding cifar-10-batches-py/ (default: ./data)")
    source.add_argument("--fake-data", action="store_true", help="random images of CIFAR-10's shape (smoke runs)")
    add_runtime_arguments(p, ckpt_every=200)
    p.add_argument("--model", choices=MODEL_CHOICES, default="resnet18")
    p.add_argument("--cnn-width", type=positive_int, default=32, help="channels of the small CNN's first stage")
    p.add_argument("--schedule", choices=("onecycle", "cosine"), default="onecycle", help="learning-rate schedule")
    p.add_argument(
        "--warmup-steps", type=non_negative_int, default=None,
        help="steps of rising LR (default: 25%% of the run for onecycle, 2%% for cosine)",
    )
    p.add_argument("--momentum", type=unit_interval, default=0.9, help="SGD momentum (Nesterov)")
    p.add_argument("--weight-decay", type=non_negative_float, default=5e-4, help="on conv and linear weights")
    p.add_argument("--label-smoothing", type=unit_interval, default=0.1)
    p.add_argument("--workers", type=non_negative_int, default=2, help="DataLoader processes per rank (0: load in the trainer)")
    p.add_argument("--eval-batch-size", type=positive_int, default=500, help="test images per rank per forward pass")
    p.add_argument("--log-every", type=positive_int, default=50, help="steps between log lines off a terminal")
    return p


@dataclass
class StepRecord:
    """A finished step whose loss is read later, so the host never waits on the device mid-loop."""

    step: int
    loss: torch.Tensor
    time: float


def total_steps(args: argparse.Namespace, num_samples: int, world_size: int) -> int:
    """--max-steps, or the steps that cover --epochs passes at this world size."""
    if args.max_steps is not None:
        return args.max_steps
    epochs = args.epochs if args.epochs is not None else DEFAULT_EPOCHS
    return max(1, math.ceil(epochs * num_samples / (args.batch_size * world_size)))


# DDP's switch for the per-step buffer broadcast was renamed in torch 2.13.
NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
    else {"broadcast_buffers": False}
)


def steps_for_epochs_left(args: argparse.Namespace, sampler: ElasticSampler, step: int, images_per_step: int) -> int:
    """With --epochs, the run's length after a restore: the steps done plus the steps
    that cover the samples left at this world size (which may differ from the saved one)."""
    epochs = args.epochs if args.epochs is not None else DEFAULT_EPOCHS
    left = epochs * sampler.num_samples - (sampler.epoch * sampler.num_samples + sampler.state.consumed)
    return step + max(0, math.ceil(left / images_per_step))


def lr_schedule(args: argparse.Namespace, steps: int) -> OneCycle | WarmupCosine:
    if args.schedule == "onecycle":
        warmup = args.warmup_steps if args.warmup_steps is not None else steps // 4
        return OneCycle(min(warmup, steps), steps)
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, steps // 50)
    return WarmupCosine(warmup, steps, min_ratio=0.0)


@torch.no_grad()
def evaluate(model: torch.nn.Module, test_set: Dataset, ctx: WorkerContext, batch_size: int) -> tuple[float, float]:
    """Accuracy and mean cross-entropy over the whole test set: rank r takes images
    r, r + W, ...; the sums are reduced over ranks."""
    model.eval()
    shard = Subset(test_set, range(ctx.rank, len(test_set), ctx.world_size))  # type: ignore[arg-type]
    totals = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # correct, loss sum, images
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if ctx.device.type == "cuda" else nullcontext()
    # Loaded in this process: see train() on forking workers once the SIGTERM handler is in.
    # A generator of its own, or each evaluation would draw from torch's global one,
    # which a resumed run must find exactly where an uninterrupted run left it.
    for x, y in DataLoader(shard, batch_size=batch_size, generator=torch.Generator()):
        x, y = x.to(ctx.device, memory_format=memory_format(ctx)), y.to(ctx.device)
        with autocast:
            logits = model(x)
        totals[0] += (logits.argmax(dim=1) == y).sum()
        totals[1] += F.cross_entropy(logits.float(), y, reduction="sum").double()
        totals[2] += len(y)
    model.train()
    if ctx.distributed:
        dist.all_reduce(totals)
    correct, loss_sum, count = totals.tolist()
    return correct / count, loss_sum / count


def memory_format(ctx: WorkerContext) -> torch.memory_format:
    """channels_last on CUDA, where convolutions run faster in it."""
    return torch.channels_last if ctx.device.type == "cuda" else torch.contiguous_format


def train(args: argparse.Namespace, ctx: WorkerContext, train_images: Dataset, test_set: Dataset) -> dict[str, Any]:
    """The training loop; returns a summary (final step, last loss, accuracy, steps/s)."""
    num_samples = len(train_images)  # type: ignore[arg-type]
    max_steps = total_steps(args, num_samples, ctx.world_size)
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    raw_model = build_model(args.model, cnn_width=args.cnn_width)
    if ctx.world_size > 1:
        raw_model = sync_batchnorm(raw_model, ctx.device)
    raw_model = raw_model.to(ctx.device, memory_format=memory_format(ctx))
    optimizer = torch.optim.SGD(
        parameter_groups(raw_model, args.weight_decay), lr=args.lr, momentum=args.momentum, nesterov=True
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(args, max_steps))
    model: torch.nn.Module = raw_model
    if ctx.distributed:
        # Synchronised batch norm keeps the buffers equal on every rank: no broadcast each step.
        model = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None, **NO_BUFFER_SYNC)
    seed_all(args.seed + ctx.rank, ctx.device)
    sampler = ElasticSampler(num_samples, batch_size=args.batch_size, seed=args.seed)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if ctx.device.type == "cuda" else nullcontext()

    with ExitStack() as cleanup:  # on every exit path: commit saves in flight, restore SIGTERM
        events = cleanup.enter_context(EventLog(args.events if ctx.is_main else None, restart=ctx.restart_count))
        hang = watchdog(args.hang_timeout)  # armed by the first completed step
        cleanup.callback(hang.close)
        cleanup.enter_context(  # before restore, so a scrape sees the restore too
            start_metrics(
                ctx, events, port=args.metrics_port, host=args.metrics_host,
                samples_per_step=args.batch_size, watchdog=hang,
            )
        )
        ckpt = CheckpointManager(
            ctx, args.ckpt_dir, every=args.ckpt_every, keep=args.ckpt_keep, model=raw_model, optimizer=optimizer,
            scheduler=scheduler, sampler=sampler, events=events, seed=args.seed,
        )
        cleanup.callback(ckpt.close)
        step = ckpt.restore()  # 0 on a fresh start; RNG, sampler and optimizer as they were at `step`
        if step and args.max_steps is None:
            # --epochs at another world size than the checkpoint's: as many steps as the
            # epochs left need, and the schedule (restored with the old length) ends there.
            resized = steps_for_epochs_left(args, sampler, step, args.batch_size * ctx.world_size)
            if resized != max_steps:
                max_steps = resized
                scheduler.lr_lambdas[0] = lr_schedule(args, max_steps)
                logger.info("--epochs at world size %d: the run now ends at step %d", ctx.world_size, max_steps)
        # The loader's workers are forked here, before the SIGTERM handler is installed:
        # a worker forked after it would share its wakeup socket, and a signal to the
        # worker alone would then read as a preemption of this process.
        augmented = SeededAugmentation(train_images, train_transform(), seed=args.seed)
        loader = step_loader(
            augmented, sampler, rank=ctx.rank, world_size=ctx.world_size, steps=max(0, max_steps - step),
            workers=args.workers, pin_memory=ctx.device.type == "cuda",
        )
        batches = iter(loader) if step < max_steps else iter(())
        preemption = PreemptionHandler(ctx, grace=args.term_grace)
        cleanup.callback(preemption.uninstall)
        faults = FaultInjector(ctx.rank, ctx.restart_count)  # ELASTIC_FAULT, for chaos tests
        images_per_step = args.batch_size * ctx.world_size
        progress = Progress(total=max_steps, initial=step, enabled=ctx.is_main, log_every=args.log_every, unit="images")
        events.emit(
            "start", step=step, world_size=ctx.world_size, run_id=ctx.run_id,
            parameters=num_parameters(raw_model), device=str(ctx.device), samples_per_step=images_per_step,
        )
        if ctx.is_main:
            logger.info(
                "training %s (%.2fM parameters) on %d train / %d test images, world size %d, device %s, "
                "step %d of %d (%.1f epochs)",
                args.model, num_parameters(raw_model) / 1e6, num_samples, len(test_set), ctx.world_size,  # type: ignore[arg-type]
                ctx.device, step, max_steps, max_steps * images_per_step / num_samples,
            )

        last_report = time.time()
        last_loss, accuracy, evaluated_at = math.nan, math.nan, -1

        def report(record: StepRecord) -> None:
            nonlocal last_report, last_loss
            last_loss = record.loss.item()
            elapsed, last_report = record.time - last_report, record.time
            events.emit("step", step=record.step, world_size=ctx.world_size, time=record.time, loss=last_loss)
            progress.update(record.step, loss=last_loss, tokens_per_s=images_per_step / max(elapsed, 1e-9))

        def validate() -> None:
            nonlocal accuracy, evaluated_at
            accuracy, test_loss = evaluate(raw_model, test_set, ctx, args.eval_batch_size)
            evaluated_at = step
            epochs_done = (sampler.epoch * num_samples + sampler.state.consumed) / num_samples
            events.emit(
                "eval", step=step, world_size=ctx.world_size, epoch=round(epochs_done, 4),
                accuracy=accuracy, test_loss=test_loss,
            )
            progress.write(f"step {step} (epoch {epochs_done:.2f}): test accuracy {accuracy:.2%}, loss {test_loss:.4f}")

        pending: StepRecord | None = None
        started, first_step = time.perf_counter(), step
        fmt = memory_format(ctx)
        while step < max_steps:
            indices = sampler.local_batch(ctx.rank, ctx.world_size)
            loaded, x, y = next(batches)
            if not torch.equal(loaded, indices):
                raise ElasticError(
                    f"step {step + 1}: the data loader produced other samples than the sampler assigns to rank "
                    f"{ctx.rank} (a bug: the loader and the sampler are out of step)"
                )
            x = x.to(ctx.device, non_blocking=True, memory_format=fmt)
            y = y.to(ctx.device, non_blocking=True)
            with autocast:
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            epoch_before = sampler.epoch
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
            if sampler.epoch > epoch_before:  # this step completed an epoch
                report(pending)
                pending = None
                with hang.paused():
                    validate()
        if pending is not None:
            report(pending)
        seconds = time.perf_counter() - started
        hang.close()  # what follows is not a training step
        if evaluated_at != step:
            validate()

        ckpt.save(step, reason="final")
        ckpt.flush()
        digests = gather_digests(ctx, parameter_digest(raw_model))  # parameters and batch norm buffers
        events.emit("end", step=step, world_size=ctx.world_size, loss=last_loss, accuracy=accuracy, param_digests=digests)
        progress.close()
        if len(set(digests)) != 1:
            raise ElasticError(f"ranks ended with different parameters (digests {digests}); the replicas diverged")
        steps_run = step - first_step
        return {
            "step": step, "loss": last_loss, "accuracy": accuracy,
            "steps_per_s": steps_run / seconds if seconds > 0 else math.inf,
        }


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.momentum <= 0:
        parser.error(f"argument --momentum: {args.momentum} must be above 0 (Nesterov momentum)")
    prefetch_slow_imports()  # overlaps loading data and joining the group
    configure_logging(rank=int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else None)
    # Check the data before joining the job: a missing or malformed folder fails fast, alone, with exit 2.
    train_images, test_images = fake_cifar10() if args.fake_data else load_cifar10(args.data or "data")
    test_set = Transformed(test_images, eval_transform())
    with worker_context(args.device, timeout=timedelta(seconds=args.collective_timeout)) as ctx:
        summary = train(args, ctx, train_images, test_set)
    if ctx.is_main:
        logger.info(
            "done: %d steps, final loss %.4f, test accuracy %.2f%%, %.2f steps/s",
            summary["step"], summary["loss"], 100 * summary["accuracy"], summary["steps_per_s"],
        )
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
