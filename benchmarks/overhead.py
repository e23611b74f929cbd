"""Runtime overhead: steps/s of recipes/gpt.py versus a plain seed-style DDP loop.

    python benchmarks/overhead.py                 # 2 ranks on CPU, prints both and the ratio

Both loops run side by side in one process tree: one `torchrun --standalone`
job whose workers alternate between the recipe's own `train()` (elastic
sampler, event log, progress, deferred loss read-out, preemption vote, and
async checkpoints every `--ckpt-every` steps) and the loop of the
PyTorch DDP tutorial (DistributedSampler + DataLoader, forward, backward,
step). Model, data, per-rank batch and optimizer update (AdamW, warmup-cosine
LR, gradient clipping at 1.0) are the same, so the ratio isolates what the
runtime adds. Steps/s is measured after `--warmup` steps, from the recipe's
own event log and from the baseline's step-end clock, as 1 / median step time
and as 1 / mean step time (the mean counts the steps that start a checkpoint,
the median is robust to a neighbour process stealing the CPU), and the median
over `--rounds` rounds (alternating which loop goes first) is reported.
Target: ratio >= 0.98.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="worker processes (one torchrun agent)")
    p.add_argument("--steps", type=int, default=40, help="steps per measured run")
    p.add_argument("--warmup", type=int, default=10, help="steps excluded from the timing")
    p.add_argument("--rounds", type=int, default=6, help="alternating recipe/baseline rounds")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--ckpt-every", type=int, default=10, help="recipe checkpoint interval (0: no checkpoints)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def steps_per_second(step_end_times: list[float], warmup: int) -> float:
    """1 / median step time after `warmup` steps: robust to the odd step slowed by
    another process on a small machine, where a mean over the run is not."""
    timed = step_end_times[max(warmup - 1, 0) :]
    return 1.0 / statistics.median(b - a for a, b in zip(timed, timed[1:]))


def mean_steps_per_second(step_end_times: list[float], warmup: int) -> float:
    """Steps / seconds over the timed window: every step counts, checkpoint steps too."""
    timed = step_end_times[max(warmup - 1, 0) :]
    return (len(timed) - 1) / (timed[-1] - timed[0])


def recipe_args(opts: argparse.Namespace, events: str, ckpt_dir: str) -> list[str]:
    ckpt = ["--ckpt-dir", ckpt_dir, "--ckpt-every", str(opts.ckpt_every)] if opts.ckpt_every else []
    return [
        "--max-steps", str(opts.steps), "--batch-size", str(opts.batch_size),
        "--eval-every", "0", "--events", events, "--device", "cpu", *ckpt,
    ]


def run_baseline(gpt, args, ctx, train_set) -> list[float]:
    """The seed-style DDP loop: DistributedSampler, DataLoader, forward, backward, step."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, Dataset, DistributedSampler

    class Windows(Dataset):
        def __len__(self) -> int:
            return len(train_set)

        def __getitem__(self, i: int):
            x, y = train_set.batch(torch.tensor([i]))
            return x[0], y[0]

    torch.manual_seed(args.seed)
    model = gpt.GPT(gpt.model_config(args))
    optimizer = gpt.configure_optimizer(model, lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, gpt.WarmupCosine(max(1, args.max_steps // 20), args.max_steps, args.min_lr_ratio)
    )
    model = DDP(model)
    dataset = Windows()
    sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    times: list[float] = []
    epoch = 0
    while len(times) < args.max_steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            _, loss = model(x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            scheduler.step()
            times.append(time.time())
            if len(times) == args.max_steps:
                break
        epoch += 1
    return times


def worker(opts: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO / "recipes"))
    import gpt  # the recipe itself, not a copy

    from elastic.events import read_events
    from elastic.runtime import barrier, worker_context

    results: dict[str, list[float]] = {"recipe": [], "baseline": [], "recipe_mean": [], "baseline_mean": []}
    with worker_context("cpu") as ctx, tempfile.TemporaryDirectory() as tmp:
        for round_ in range(opts.rounds):
            events = os.path.join(tmp, f"round{round_}.jsonl")
            # A fresh directory per round: each recipe run starts at step 0, none resumes.
            args = gpt.build_parser().parse_args(recipe_args(opts, events, os.path.join(tmp, f"ckpt{round_}")))
            corpus = gpt.load_corpus(args.data)
            train_set, val_set = gpt.split_corpus(corpus, block_size=args.block_size)

            def recipe() -> None:
                gpt.train(args, ctx, train_set, val_set)
                times = [e["time"] for e in read_events(events) if e["event"] == "step"] if ctx.is_main else []
                results["recipe"].append(steps_per_second(times, opts.warmup) if times else 0.0)
                results["recipe_mean"].append(mean_steps_per_second(times, opts.warmup) if times else 0.0)

            def baseline() -> None:
                times = run_baseline(gpt, args, ctx, train_set)
                results["baseline"].append(steps_per_second(times, opts.warmup))
                results["baseline_mean"].append(mean_steps_per_second(times, opts.warmup))

            # Alternate which goes first, so a drift in machine speed hits both alike.
            for run in (recipe, baseline) if round_ % 2 == 0 else (baseline, recipe):
                barrier(ctx)
                run()
        if ctx.is_main and opts.out:
            Path(opts.out).write_text(json.dumps(results))


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.worker:
        worker(opts)
        return 0
    if opts.steps <= opts.warmup + 1:
        sys.exit("overhead.py: error: --steps must exceed --warmup + 1")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(opts).items() if k not in {"worker", "out"}]
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={opts.ranks}",
            __file__, "--worker", f"--out={out}", *forwarded,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING"}
        subprocess.run(command, check=True, env=env, cwd=REPO)
        results = json.loads(Path(out).read_text())
    recipe, baseline = statistics.median(results["recipe"]), statistics.median(results["baseline"])
    print(f"ranks={opts.ranks} steps={opts.steps} (timed after {opts.warmup}) rounds={opts.rounds} device=cpu")
    print("recipe   steps/s per round: " + " ".join(f"{v:.3f}" for v in results["recipe"]))
    print("baseline steps/s per round: " + " ".join(f"{v:.3f}" for v in results["baseline"]))
    recipe_mean, baseline_mean = statistics.median(results["recipe_mean"]), statistics.median(results["baseline_mean"])
    print(f"ranks={opts.ranks} checkpoint every {opts.ckpt_every} steps" if opts.ckpt_every else "no checkpoints")
    print(f"recipe/gpt.py {recipe:.3f} steps/s | seed-style DDP {baseline:.3f} steps/s | ratio {recipe / baseline:.3f} (1/median step)")
    print(
        f"recipe/gpt.py {recipe_mean:.3f} steps/s | seed-style DDP {baseline_mean:.3f} steps/s | "
        f"ratio {recipe_mean / baseline_mean:.3f} (steps/seconds, checkpoint steps included)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
