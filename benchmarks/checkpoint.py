"""Checkpoint stall: seconds the training loop blocks per async checkpoint / seconds of a synchronous `torch.save`.

    python benchmarks/checkpoint.py                      # the recipe's GPT and a ~100M GPT, on CPU
    python benchmarks/checkpoint.py --configs recipe --saves 20

Both figures come from one process, side by side, for each model: the GPT
recipe's default model (recipes/gpt.py: 4 layers x 128 wide, context 128,
batch 16, 0.84M parameters) and a ~100M-parameter GPT (14 layers x 768 wide,
12 heads, context 256, batch 4). Each trains on random tokens exactly as the
recipe does (AdamW from `configure_optimizer`, warmup-cosine LR, gradient
clipping at 1.0, the elastic sampler) for `--warmup-steps` steps first, so
the AdamW moments exist and the state is full size.

- Synchronous: `torch.save` of the same state a checkpoint holds (model and
  optimizer `state_dict()`, scheduler, sampler and RNG states; building the
  state dicts is timed too) into one file in the same temporary directory,
  median of `--repeats`. No fsync, as a typical `torch.save` loop does: a
  durable synchronous save would only be slower, so this denominator is the
  conservative one. Dirty pages are flushed (untimed) between measurements.
- Async: a `CheckpointManager` in that directory, `save(step)` every
  `--every` training steps, `--saves` times, with real steps between saves
  so the deferred copy of parameters and optimizer state overlaps the next
  forward/backward as in the recipe, and `--every` more steps after the last
  one. Blocking seconds per save are the manager's own `blocking_seconds`:
  the `save()` call from after the RNG gather (waiting for the previous save
  to commit, `state_dict()`, copy of the small immediate tensors, starting
  the writer) plus any wait in the optimizer-step pre-hook for the deferred
  copy. The first save allocates the reusable copy buffers (page faults), so
  the ratio uses the median of the later saves (steady state); the first is
  printed beside it. Commit seconds run from the start of a save to its
  commit (copy, serialise, sha256, fsync, rename on the writer thread).

Also printed per model: the steady blocking timed from outside the manager
(the whole `save()` call, RNG gather included, plus the pre-hook wait, timed
by two hooks registered before and after the manager's) and its split; and
the median step time with and without a save in flight (the writer thread
shares the cores with the loop: that slowdown is not blocking, but it is a
cost). Target: ratio <= 0.05.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "recipes"))

from gpt_model import BYTE_VOCAB, GPT, GPTConfig, configure_optimizer  # noqa: E402

from elastic.checkpoint import CheckpointManager  # noqa: E402
from elastic.cli import OneLineArgumentParser, non_negative_int, positive_int  # noqa: E402
from elastic.rng import get_rng_state, seed_all  # noqa: E402
from elastic.runtime import WorkerContext, init_worker  # noqa: E402
from elastic.sampler import ElasticSampler  # noqa: E402
from elastic.schedules import WarmupCosine  # noqa: E402

TARGET = 0.05


@dataclass(frozen=True)
class Setup:
    name: str
    model: GPTConfig
    batch_size: int
    saves: int


SETUPS = {
    # recipes/gpt.py defaults: GPTConfig() and --batch-size 16.
    "recipe": Setup("recipe", GPTConfig(), batch_size=16, saves=30),
    # 99.6M parameters (n_layer 14; 13 gives 92.5M, 15 gives 106.7M).
    "100m": Setup("100m", GPTConfig(block_size=256, n_layer=14, n_head=12, n_embd=768), batch_size=4, saves=3),
}
TINY = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64)
"""--tiny: every config shrunk to this, for smoke tests (the figures mean nothing)."""

# The recipe's optimiser settings (recipes/gpt.py defaults).
LR, WEIGHT_DECAY, MIN_LR_RATIO, GRAD_CLIP = 1e-3, 0.1, 0.1, 1.0


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="checkpoint.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", choices=("recipe", "100m", "both"), default="both", help="which models to measure")
    p.add_argument("--saves", type=positive_int, default=None,
                   help="async saves per model (default: 30 for recipe, 3 for 100m; >= 2 for a steady-state figure)")
    p.add_argument("--every", type=positive_int, default=2, help="training steps between async saves")
    p.add_argument("--repeats", type=positive_int, default=3, help="synchronous torch.save runs (median reported)")
    p.add_argument("--warmup-steps", type=positive_int, default=3, help="training steps before anything is timed")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="sequences per step (default: 16 for recipe, 4 for 100m)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--dir", default=None, help="make the temporary directory here (default: the system temp dir)")
    p.add_argument("--samples", type=positive_int, default=512, help="random token windows in the data set")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--tiny", action="store_true",
                   help="shrink every model to 2 layers x 64 wide, context 32 (smoke tests)")
    return p


@dataclass
class Result:
    name: str
    parameters: int
    state_mb: float
    sync_seconds: float
    first_blocking: float
    steady_blocking: float
    steady_call: float
    steady_hook_wait: float
    steady_loop_blocking: float
    commit_seconds: float
    step_free: float
    step_in_flight: float

    @property
    def ratio(self) -> float:
        return self.steady_blocking / self.sync_seconds


class Trainer:
    """The recipe's training step on random tokens, single process."""

    def __init__(self, cfg: GPTConfig, batch_size: int, samples: int, seed: int, ctx: WorkerContext) -> None:
        torch.manual_seed(seed)
        self.model = GPT(cfg)
        self.optimizer = configure_optimizer(self.model, lr=LR, weight_decay=WEIGHT_DECAY)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, WarmupCosine(10, 1000, MIN_LR_RATIO))
        self.sampler = ElasticSampler(samples, batch_size=batch_size, seed=seed)
        self.data = torch.randint(0, BYTE_VOCAB, (samples, cfg.block_size + 1))
        self.ctx = ctx
        seed_all(seed, ctx.device)

    def step(self) -> None:
        window = self.data[self.sampler.local_batch(0, 1)]
        _, loss = self.model(window[:, :-1], window[:, 1:])
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
        self.optimizer.step()
        self.scheduler.step()
        self.sampler.advance(1)

    def state(self) -> dict[str, Any]:
        """What a checkpoint holds, as one object for a plain torch.save."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "trainer": {
                "sampler": self.sampler.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "rng": [get_rng_state(self.ctx.device)],
            },
        }


def time_sync_save(trainer: Trainer, directory: Path, repeats: int) -> tuple[float, int]:
    """Median seconds of `torch.save(state)` (no fsync), and the file's size in bytes."""
    seconds, size = [], 0
    for i in range(repeats):
        path = directory / f"sync_{i}.pt"
        os.sync()  # start from clean page cache writeback, untimed
        started = time.perf_counter()
        torch.save(trainer.state(), path)
        seconds.append(time.perf_counter() - started)
        size = path.stat().st_size
        path.unlink()
    os.sync()
    return statistics.median(seconds), size


def measure(setup: Setup, opts: argparse.Namespace, ctx: WorkerContext, tmp: Path) -> Result:
    cfg = TINY if opts.tiny else setup.model
    batch_size = opts.batch_size or (4 if opts.tiny else setup.batch_size)
    saves = opts.saves or setup.saves
    trainer = Trainer(cfg, batch_size, opts.samples, opts.seed, ctx)
    steps: list[tuple[float, float]] = []  # (start, end) wall clock of each timed step

    def timed_step() -> None:
        started = time.time()
        trainer.step()
        steps.append((started, time.time()))

    trainer.step()  # first step: allocations, lazy init; never timed
    for _ in range(opts.warmup_steps - 1):
        timed_step()

    sync_seconds, state_bytes = time_sync_save(trainer, tmp, opts.repeats)

    # Pre-hooks run in registration order: these two bracket the manager's, which
    # waits for the deferred copy, so their gap is the loop's wait there.
    hook_wait: dict[int, float] = {}  # save step -> seconds waited in later optimizer steps
    bracket = {"started": 0.0}
    before = trainer.optimizer.register_step_pre_hook(lambda *_: bracket.update(started=time.perf_counter()))
    ckpt = CheckpointManager(
        ctx, tmp / f"ckpt_{setup.name}", model=trainer.model, optimizer=trainer.optimizer,
        scheduler=trainer.scheduler, sampler=trainer.sampler, every=0, keep=2, seed=opts.seed,
    )
    calls: dict[int, tuple[float, float]] = {}  # save step -> (wall start, seconds in save())

    def after_manager_hook(*_: Any) -> None:
        if calls:
            last = max(calls)
            hook_wait[last] = hook_wait.get(last, 0.0) + time.perf_counter() - bracket["started"]

    after = trainer.optimizer.register_step_pre_hook(after_manager_hook)
    step = opts.warmup_steps
    try:
        for _ in range(saves):
            for i in range(opts.every):
                timed_step()
                step += 1
                if i == opts.every - 1:
                    wall, started = time.time(), time.perf_counter()
                    ckpt.save(step)
                    calls[step] = (wall, time.perf_counter() - started)
                else:
                    ckpt.maybe_save(step)  # every=0: only reports saves that finished, as the recipe's loop does
        for _ in range(opts.every):  # the last save's deferred copy overlaps these, and the pre-hook may wait
            timed_step()
            step += 1
            ckpt.maybe_save(step)
        ckpt.flush()
    finally:
        ckpt.close()
        before.remove()
        after.remove()

    history = sorted(ckpt.history, key=lambda h: h["step"])
    blocking = [h["blocking_seconds"] for h in history]
    steady = history[1:] or history
    in_flight = [(calls[h["step"]][0], calls[h["step"]][0] + h["seconds"]) for h in history]

    def overlaps(s: tuple[float, float]) -> bool:
        return any(s[0] < end and start < s[1] for start, end in in_flight)

    free = [b - a for a, b in steps if not overlaps((a, b))]
    busy = [b - a for a, b in steps if overlaps((a, b))]
    median = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    return Result(
        name=setup.name,
        parameters=trainer.model.num_parameters(),
        state_mb=state_bytes / 1e6,
        sync_seconds=sync_seconds,
        first_blocking=blocking[0],
        steady_blocking=median([h["blocking_seconds"] for h in steady]),
        steady_call=median([calls[h["step"]][1] for h in steady]),
        steady_hook_wait=median([hook_wait.get(h["step"], 0.0) for h in steady]),
        steady_loop_blocking=median([calls[h["step"]][1] + hook_wait.get(h["step"], 0.0) for h in steady]),
        commit_seconds=median([h["seconds"] for h in steady]),
        step_free=median(free),
        step_in_flight=median(busy),
    )


def report(results: list[Result]) -> None:
    header = ("config", "params", "state MB", "sync save s", "blocking s first", "blocking s steady",
              "ratio", "commit s", f"ratio <= {TARGET}")
    rows = [
        (r.name, f"{r.parameters / 1e6:.2f}M", f"{r.state_mb:.1f}", f"{r.sync_seconds:.4f}", f"{r.first_blocking:.5f}",
         f"{r.steady_blocking:.5f}", f"{r.ratio:.4f}", f"{r.commit_seconds:.3f}", "yes" if r.ratio <= TARGET else "NO")
        for r in results
    ]
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(str(cell).rjust(w) for cell, w in zip(row, widths)))
    for r in results:
        print(
            f"{r.name}: timed around the manager, a steady save blocks the loop {r.steady_loop_blocking:.5f} s "
            f"(ratio {r.steady_loop_blocking / r.sync_seconds:.4f}) = save() call {r.steady_call:.5f} s "
            f"+ optimizer-step pre-hook wait {r.steady_hook_wait:.5f} s"
        )
        print(
            f"{r.name}: step {r.step_free:.4f} s without a save in flight, {r.step_in_flight:.4f} s with one "
            f"({r.step_in_flight / r.step_free - 1:+.0%})"
        )
    for r in results:
        verdict = "met" if r.ratio <= TARGET else "MISSED"
        print(f"{r.name}: checkpoint stall ratio {r.ratio:.4f} (target <= {TARGET}: {verdict})")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    opts = parser.parse_args(argv)
    if opts.dir is not None and not os.path.isdir(opts.dir):
        parser.error(f"--dir {opts.dir} is not a directory")
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    ctx = init_worker("cpu", environ={})  # one process, no process group
    names = ["recipe", "100m"] if opts.configs == "both" else [opts.configs]
    tmp = Path(tempfile.mkdtemp(prefix="elastic-ckpt-bench-", dir=opts.dir))
    try:
        print(
            f"device=cpu threads={torch.get_num_threads()} every={opts.every} steps repeats={opts.repeats} "
            f"warmup={opts.warmup_steps} steps{' tiny' if opts.tiny else ''} dir={tmp}",
            flush=True,
        )
        results = [measure(SETUPS[name], opts, ctx, tmp) for name in names]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
