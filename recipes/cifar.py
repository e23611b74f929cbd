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

Each step the job takes the next global batch of the elastic sampler's stream:
an ordinary DataLoader with worker processes, driven by `run.batch_sampler()`,
prepares this rank's share of the steps to come, each image augmented from a
seed of (seed, epoch, index) alone (`elastic._worker.data.feed.seeded_samples`), so a job
resumed after a kill ends bit-identical to one never interrupted.
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
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # models beside the recipe

from cifar_data import (  # noqa: E402
    Transformed,
    eval_transform,
    fake_cifar10,
    load_cifar10,
    train_transform,
)
from cifar_model import (  # noqa: E402
    MODEL_CHOICES,
    build_model,
    parameter_groups,
    sync_batchnorm,
)

import elastic  # noqa: E402
from elastic import (  # noqa: E402
    ElasticSampler,
    OneCycle,
    OneLineArgumentParser,
    WarmupCosine,
    configure_logging,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    prefetch_slow_imports,
    run_main,
    seeded_samples,
    unit_interval,
)

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
    source = p.add_mutually_exclusive_group()
    source.add_argument("--data", default=None, help="folder holding cifar-10-batches-py/ (default: ./data)")
    source.add_argument("--fake-data", action="store_true", help="random images of CIFAR-10's shape (smoke runs)")
    elastic.add_runtime_arguments(p, ckpt_every=200, seed=1337, log_every=50)  # this recipe's own defaults
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
    return p


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
def evaluate(model: torch.nn.Module, test_set: Dataset, run: elastic.Run, batch_size: int) -> tuple[float, float]:
    """Accuracy and mean cross-entropy over the whole test set: rank r takes images
    r, r + W, ...; the sums are reduced over ranks."""
    model.eval()
    shard = Subset(test_set, range(run.rank, len(test_set), run.world_size))  # type: ignore[arg-type]
    totals = torch.zeros(3, dtype=torch.float64, device=run.device)  # correct, loss sum, images
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if run.device.type == "cuda" else nullcontext()
    # A generator of its own, or each evaluation would draw from torch's global one,
    # which a resumed run must find exactly where an uninterrupted run left it.
    for x, y in DataLoader(shard, batch_size=batch_size, generator=torch.Generator()):
        x, y = x.to(run.device, memory_format=memory_format(run.device)), y.to(run.device)
        with autocast:
            logits = model(x)
        totals[0] += (logits.argmax(dim=1) == y).sum()
        totals[1] += F.cross_entropy(logits.float(), y, reduction="sum").double()
        totals[2] += len(y)
    model.train()
    if run.distributed:
        dist.all_reduce(totals)
    correct, loss_sum, count = totals.tolist()
    return correct / count, loss_sum / count


def memory_format(device: torch.device) -> torch.memory_format:
    """channels_last on CUDA, where convolutions run faster in it."""
    return torch.channels_last if device.type == "cuda" else torch.contiguous_format


def train(args: argparse.Namespace, train_images: Dataset, test_set: Dataset) -> dict:
    """The training loop; returns a summary (final step, last loss, accuracy, steps/s)."""
    num_samples = len(train_images)  # type: ignore[arg-type]
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    with elastic.Run.from_args(args) as run:
        max_steps = total_steps(args, num_samples, run.world_size)
        fmt = memory_format(run.device)
        raw_model = build_model(args.model, cnn_width=args.cnn_width)
        if run.world_size > 1:
            raw_model = sync_batchnorm(raw_model, run.device)
        raw_model = raw_model.to(run.device, memory_format=fmt)
        optimizer = torch.optim.SGD(
            parameter_groups(raw_model, args.weight_decay), lr=args.lr, momentum=args.momentum, nesterov=True
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(args, max_steps))
        # Synchronised batch norm keeps the buffers equal on every rank: no broadcast each step.
        model = run.ddp(raw_model, **NO_BUFFER_SYNC)
        step = run.start(
            model=raw_model, optimizer=optimizer, scheduler=scheduler, data=train_images, batch_size=args.batch_size
        )
        if step and args.max_steps is None:
            # --epochs at another world size than the checkpoint's: as many steps as the
            # epochs left need, and the schedule (restored with the old length) ends there.
            resized = steps_for_epochs_left(args, run.sampler, step, args.batch_size * run.world_size)
            if resized != max_steps:
                max_steps = resized
                scheduler.lr_lambdas[0] = lr_schedule(args, max_steps)
                logger.info("--epochs at world size %d: the run now ends at step %d", run.world_size, max_steps)
        loader = DataLoader(
            seeded_samples(Transformed(train_images, train_transform()), args.seed),
            batch_sampler=run.batch_sampler(), num_workers=args.workers, pin_memory=run.device.type == "cuda",
        )
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if run.device.type == "cuda" else nullcontext()
        accuracy, evaluated_at = math.nan, -1

        def validate() -> None:
            nonlocal accuracy, evaluated_at
            with run.pause():
                accuracy, test_loss = evaluate(raw_model, test_set, run, args.eval_batch_size)
            evaluated_at = run.step
            run.event("eval", epoch=round(run.epochs_done, 4), accuracy=accuracy, test_loss=test_loss)
            run.print(f"step {run.step} (epoch {run.epochs_done:.2f}): test accuracy {accuracy:.2%}, loss {test_loss:.4f}")

        epoch = run.epoch
        for x, y in run.batches(loader, max_steps=max_steps):
            if run.epoch != epoch:  # the last step completed an epoch
                epoch = run.epoch
                validate()
            x = x.to(run.device, non_blocking=True, memory_format=fmt)
            y = y.to(run.device, non_blocking=True)
            with autocast:
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            run.log(loss)
        if evaluated_at != run.step:
            validate()
        return {**run.finish(accuracy=accuracy), "accuracy": accuracy}


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
    summary = train(args, train_images, test_set)
    if summary["rank"] == 0:
        logger.info(
            "done: %d steps, final loss %.4f, test accuracy %.2f%%, %.2f steps/s",
            summary["step"], summary["loss"], 100 * summary["accuracy"], summary["steps_per_s"],
        )
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
