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

Metrics: the recipe runs with `--metrics-port` on, and the benchmark scrapes
every worker's /metrics every `--scrape-interval` seconds while it trains (far
more often than Prometheus' usual 15 s), so the ratio includes what metrics
cost. A third loop, the recipe with metrics off, runs in the same rounds; the
with / without ratio is the metrics' own cost.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
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
    p.add_argument("--metrics-port", type=int, default=None, help="base port of the workers' /metrics (default: a free one)")
    p.add_argument("--scrape-interval", type=float, default=1.0, help="seconds between scrapes of each worker")
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


def recipe_args(opts: argparse.Namespace, events: str, ckpt_dir: str, metrics_port: int) -> list[str]:
    ckpt = ["--ckpt-dir", ckpt_dir, "--ckpt-every", str(opts.ckpt_every)] if opts.ckpt_every else []
    return [
        "--max-steps", str(opts.steps), "--batch-size", str(opts.batch_size),
        "--eval-every", "0", "--events", events, "--device", "cpu", "--metrics-port", str(metrics_port), *ckpt,
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

    loops = ("recipe", "recipe_no_metrics", "baseline")
    results: dict[str, list[float]] = {f"{name}{kind}": [] for name in loops for kind in ("", "_mean")}
    with worker_context("cpu") as ctx, tempfile.TemporaryDirectory() as tmp:
        corpus = gpt.load_corpus(None)
        for round_ in range(opts.rounds):

            def recipe_args_for(name: str, metrics_port: int) -> argparse.Namespace:
                # A fresh directory per run: each recipe run starts at step 0, none resumes.
                events = os.path.join(tmp, f"{name}{round_}.jsonl")
                return gpt.build_parser().parse_args(
                    recipe_args(opts, events, os.path.join(tmp, f"ckpt-{name}{round_}"), metrics_port)
                )

            def recipe(name: str, metrics_port: int) -> None:
                args = recipe_args_for(name, metrics_port)
                train_set, val_set = gpt.split_corpus(corpus, block_size=args.block_size)
                gpt.train(args, ctx, train_set, val_set)
                times = [e["time"] for e in read_events(args.events) if e["event"] == "step"] if ctx.is_main else []
                results[name].append(steps_per_second(times, opts.warmup) if times else 0.0)
                results[f"{name}_mean"].append(mean_steps_per_second(times, opts.warmup) if times else 0.0)

            def baseline() -> None:
                args = recipe_args_for("baseline", 0)
                train_set, _ = gpt.split_corpus(corpus, block_size=args.block_size)
                times = run_baseline(gpt, args, ctx, train_set)
                results["baseline"].append(steps_per_second(times, opts.warmup))
                results["baseline_mean"].append(mean_steps_per_second(times, opts.warmup))

            runs = [lambda: recipe("recipe", opts.metrics_port), lambda: recipe("recipe_no_metrics", 0), baseline]
            # Rotate which goes first, so a drift in machine speed hits all alike.
            for run in runs[round_ % 3:] + runs[: round_ % 3]:
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
    if opts.metrics_port is None:
        opts.metrics_port = free_port_block(opts.ranks)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(opts).items() if k not in {"worker", "out"}]
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={opts.ranks}",
            __file__, "--worker", f"--out={out}", *forwarded,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING"}
        with Scraper([opts.metrics_port + r for r in range(opts.ranks)], opts.scrape_interval) as scraper:
            subprocess.run(command, check=True, env=env, cwd=REPO)
        results = json.loads(Path(out).read_text())
    if scraper.scrapes == 0:
        sys.exit("overhead.py: error: no worker served /metrics: the 'metrics on' runs measured nothing of metrics")
    med = {name: statistics.median(values) for name, values in results.items()}
    print(f"ranks={opts.ranks} steps={opts.steps} (timed after {opts.warmup}) rounds={opts.rounds} device=cpu")
    for name in ("recipe", "recipe_no_metrics", "baseline"):
        print(f"{name:17} steps/s per round: " + " ".join(f"{v:.3f}" for v in results[name]))
    print(f"ranks={opts.ranks} checkpoint every {opts.ckpt_every} steps" if opts.ckpt_every else "no checkpoints")
    print(f"metrics scraped {scraper.scrapes} times ({scraper.failures} refused between runs), every {opts.scrape_interval:g} s per worker")
    recipe, baseline = med["recipe"], med["baseline"]
    print(f"recipe/gpt.py {recipe:.3f} steps/s | seed-style DDP {baseline:.3f} steps/s | ratio {recipe / baseline:.3f} (1/median step)")
    print(
        f"recipe/gpt.py {med['recipe_mean']:.3f} steps/s | seed-style DDP {med['baseline_mean']:.3f} steps/s | "
        f"ratio {med['recipe_mean'] / med['baseline_mean']:.3f} (steps/seconds, checkpoint steps included)"
    )
    print(
        f"metrics on / off: {recipe / med['recipe_no_metrics']:.3f} (1/median step), "
        f"{med['recipe_mean'] / med['recipe_no_metrics_mean']:.3f} (steps/seconds)"
    )
    return 0


def free_port_block(count: int) -> int:
    """A base port whose next `count` ports are free now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count <= 65535 and all(_free(base + i) for i in range(count)):
            return base
    raise RuntimeError("no block of free ports found")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Scraper:
    """Scrapes each worker's /metrics every `interval` seconds, as Prometheus would."""

    def __init__(self, ports: list[int], interval: float) -> None:
        self.ports, self.interval = ports, interval
        self.scrapes = self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for port in self.ports:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                        response.read()
                    self.scrapes += 1
                except OSError:
                    self.failures += 1  # no recipe run is serving right now

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

if __name__ == "__main__":
    sys.exit(main())
