"""Checkpoint stall: seconds the training loop blocks per async checkpoint / seconds of a synchronous `torch.save`.

    python benchmarks/checkpoint.py                      # the recipe's GPT and a ~100M GPT, on CPU, then
                                                         # today's path vs the new one at 1, 2, 4 ranks
    python benchmarks/checkpoint.py --configs recipe --saves 20 --ranks none
    python benchmarks/checkpoint.py --quick              # the rank comparison only: recipe GPT, 1 and 2 ranks

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
  commit (copy, serialise, checksums, fsync, rename on the writer thread).

Also printed per model: the steady blocking timed from outside the manager
(the whole `save()` call, RNG gather included, plus the pre-hook wait, timed
by two hooks registered before and after the manager's) and its split; and
the median step time with and without a save in flight (the writer thread
shares the cores with the loop: that slowdown is not blocking, but it is a
cost). Target: ratio <= 0.05.

Then, several ranks (`--ranks`, default 1,2,4; `--modes` ddp,fsdp): today's
rank-0 path against the new sharded one, side by side, one row each. Every
row is two torchrun jobs (`--standalone`, gloo on CPU) of
benchmarks/checkpoint_worker.py: a save job, then a restore job in fresh
processes, as after a restart. "today" runs the real code of commit 6ec689c:
`git archive 6ec689c elastic recipes` is extracted into a temporary
directory and the workers run with PYTHONPATH pointing there (rank 0 writes
model.pt, optimizer.pt and trainer.pt with torch.save and a sha256 each on
its writer thread; on restore every rank reads and hashes all of it). "new"
runs HEAD's committed tree, extracted the same way (`--new-ref`; `worktree`
runs this checkout as it is): every rank writes its share through
torch.distributed.checkpoint; restore reads each chunk once, crc32c
checked. 6ec689c has no FSDP support (its rank 0 would save only its own
shards), so its FSDP rows say "not supported" instead of a figure. The model
is the ~100M GPT above (`--dist-model`); its training steps are shortened to
`--dist-context` 64 tokens x `--dist-batch-size` 1 sequence per rank, so that
four ranks train on two cores at all: the checkpoint holds the same bytes
whatever the batch, but the deferred copy has less step time to hide behind.
Each rank gets cores // ranks torch threads (at least 1). Per row:

- stall s: per save, the loop's blocking timed around the manager on every
  rank (the whole `save()` call plus the optimizer-step pre-hook wait, by
  two hooks bracketing the manager's), the largest over ranks (a DDP step
  waits for the slowest rank); the median over saves after the first
  (steady state). Each save starts with none in flight (an untimed
  `flush()` before it) and after an untimed barrier, so no save is skipped
  and no rank's wait for a slower peer counts as a stall. The first save's
  figure and rank 0's own manager `blocking_seconds` are printed below the
  table.
- sync s / ratio: the loop stall of a synchronous torch.save of the same
  state in the same job, from a barrier to the next, no fsync, median of
  `--dist-repeats`: under DDP rank 0 saves the whole state while the others
  wait (a typical DDP loop); under FSDP every rank saves its own shards, in
  parallel. ratio = stall s / sync s.
- commit s: rank 0's `history` seconds, start of a save to its commit
  (median of the steady saves; training goes on meanwhile).
- restore s: `CheckpointManager.restore()` in the restore job, the slowest
  rank. The restore job builds the model and optimizer as the save job did
  (FSDP2-sharded for fsdp; for ddp the bare model, since the DDP wrapper
  plays no part in a restore) and restores the save job's final checkpoint;
  "restored" says whether the restored model and optimizer state (sum and
  sum of squares of every tensor, shards summed over ranks) equal what was
  saved.
- read MB / read/ckpt: bytes the restore read from the checkpoint's own files,
  summed over ranks (every `open()` of a file under the checkpoint directory
  is counted, both paths read through it), and that over the checkpoint's
  size on disk (all its files). Small bookkeeping reads outside it (the
  new store's `latest` pointer and writer claim, a few hundred bytes) are
  printed below the table. The new manager's own `restored_bytes` (tensor
  chunks only) is printed beside it.
- save RSS MB / restore RSS MB: peak host memory of the node, as the sum
  over ranks of each process's peak RSS (ru_maxrss, lifetime of the job:
  torch itself, the model, training and the saves for the save job; the
  model, optimizer and the restore for the restore job). The RSS growth
  during the restore alone (peak minus RSS just before it, summed) is printed
  below the table.

Sizes: the full run (1, 2 and 4 ranks of the 100M GPT, DDP and FSDP) needed
no reduction on a 2-core, 24 GB machine: its largest node peak was today's
path restoring at 4 ranks, 14.0 GB (every rank holds the whole checkpoint's
bytes and their unpickled tensors at once); it took about 20 minutes with the
cores shared. Only the training steps are shortened (context 64 x batch 1).
The synchronous torch.save writes into the page cache, so its seconds (and
the ratio) move with whatever else writes on the machine.

`--quick` is the comparison only, on the recipe's GPT (context 32), at 1 and
2 ranks, 2 saves, 1 synchronous repeat: about 2 minutes on 2 cores (1.9 to
3 measured on shared ones), most of it torch's import time in 12 launches.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "recipes"))

sys.path.insert(0, str(REPO / "benchmarks"))  # its siblings, by plain name
from common import HookWait, median  # noqa: E402
from provenance import write_result  # noqa: E402
from gpt_model import BYTE_VOCAB, GPT, GPTConfig, configure_optimizer  # noqa: E402

from elastic._shared.common.cli import (  # noqa: E402
    OneLineArgumentParser,
    non_negative_int,
    positive_int,
)
from elastic._worker.checkpoint import CheckpointManager  # noqa: E402
from elastic._worker.config import RunConfig  # noqa: E402
from elastic._worker.data.sampler import ElasticSampler  # noqa: E402
from elastic._worker.run.schedules import WarmupCosine  # noqa: E402
from elastic._worker.runtime.context import WorkerContext, init_worker  # noqa: E402
from elastic._worker.runtime.rng import get_rng_state, seed_all  # noqa: E402

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
    p.add_argument("--configs", choices=("recipe", "100m", "both", "none"), default=None,
                   help="which models to measure in one process (default: both; none with --quick)")
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
    g = p.add_argument_group("today's rank-0 path vs the sharded path, several ranks (gloo on CPU, torchrun)")
    g.add_argument("--ranks", type=rank_list, default=None,
                   help="world sizes to compare, comma-separated, or none (default: 1,2,4; 1,2 with --quick)")
    g.add_argument("--modes", type=mode_list, default=["ddp", "fsdp"], help="ddp, fsdp or both (default: ddp,fsdp)")
    g.add_argument("--dist-model", choices=("recipe", "100m"), default=None,
                   help="model of the comparison (default: 100m; recipe with --quick)")
    g.add_argument("--dist-saves", type=positive_int, default=None,
                   help="timed async saves per job (default: 3; 2 with --quick; the first is not steady)")
    g.add_argument("--dist-every", type=positive_int, default=2, help="training steps between async saves")
    g.add_argument("--dist-repeats", type=positive_int, default=None,
                   help="synchronous torch.save runs per job (default: 3; 1 with --quick)")
    g.add_argument("--dist-context", type=positive_int, default=None,
                   help="tokens per training sequence (default: 64; 32 with --quick)")
    g.add_argument("--dist-batch-size", type=positive_int, default=1, help="sequences per rank per step")
    g.add_argument("--dist-threads", type=positive_int, default=None,
                   help="torch threads per rank (default: cores // ranks, at least 1)")
    g.add_argument("--dist-timeout", type=positive_int, default=3600, help="seconds one launch may take")
    g.add_argument("--new-ref", default="HEAD",
                   help="commit whose elastic/ is the new path, extracted like today's (default: HEAD), or worktree: "
                        "this checkout as it is")
    p.add_argument("--json", default=None, help="write the figures and their provenance here (benchmarks/provenance.py)")
    g.add_argument("--quick", action="store_true",
                   help="the comparison only, on the recipe model, at 1 and 2 ranks, 2 saves (about 1-2 min)")
    return p


def rank_list(text: str) -> list[int]:
    if text == "none":
        return []
    try:
        ranks = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of world sizes, or none") from None
    if not ranks or any(r < 1 for r in ranks):
        raise argparse.ArgumentTypeError(f"world sizes must be 1 or more, got {text!r}")
    return ranks


def mode_list(text: str) -> list[str]:
    modes = text.split(",")
    if not modes or any(m not in ("ddp", "fsdp") for m in modes):
        raise argparse.ArgumentTypeError(f"{text!r}: modes are ddp and fsdp, comma-separated")
    return modes


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

    # Two pre-hooks bracket the manager's, which waits for the deferred copy: their gap is the loop's wait there.
    hook_wait = HookWait(trainer.optimizer)
    ckpt = CheckpointManager(
        ctx, RunConfig(ckpt_dir=tmp / f"ckpt_{setup.name}", ckpt_every=0, ckpt_keep=2, seed=opts.seed, snapshot_every=0),
        model=trainer.model, optimizer=trainer.optimizer, scheduler=trainer.scheduler, sampler=trainer.sampler,
    )
    calls: dict[int, tuple[float, float]] = {}  # save step -> (wall start, seconds in save())
    hook_wait.after_manager(calls)
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
        hook_wait.remove()

    history = sorted(ckpt.history, key=lambda h: h["step"])
    blocking = [h["blocking_seconds"] for h in history]
    steady = history[1:] or history
    in_flight = [(calls[h["step"]][0], calls[h["step"]][0] + h["seconds"]) for h in history]

    def overlaps(s: tuple[float, float]) -> bool:
        return any(s[0] < end and start < s[1] for start, end in in_flight)

    free = [b - a for a, b in steps if not overlaps((a, b))]
    busy = [b - a for a, b in steps if overlaps((a, b))]
    return Result(
        name=setup.name,
        parameters=trainer.model.num_parameters(),
        state_mb=state_bytes / 1e6,
        sync_seconds=sync_seconds,
        first_blocking=blocking[0],
        steady_blocking=median([h["blocking_seconds"] for h in steady], math.nan),
        steady_call=median([calls[h["step"]][1] for h in steady], math.nan),
        steady_hook_wait=median([hook_wait.seconds.get(h["step"], 0.0) for h in steady], math.nan),
        steady_loop_blocking=median([calls[h["step"]][1] + hook_wait.seconds.get(h["step"], 0.0) for h in steady],
                                    math.nan),
        commit_seconds=median([h["seconds"] for h in steady], math.nan),
        step_free=median(free, math.nan),
        step_in_flight=median(busy, math.nan),
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


# -- today's rank-0 path vs the sharded path, several ranks ------------------------------------

TODAY = "6ec689c"
"""The commit whose CheckpointManager is today's path: rank 0 torch.saves model.pt, optimizer.pt and
trainer.pt with a sha256 each on its writer thread; on restore every rank reads and hashes all of it."""
WORKER = REPO / "benchmarks" / "checkpoint_worker.py"
DIST_MODELS = {"recipe": SETUPS["recipe"].model, "100m": SETUPS["100m"].model}
FSDP_TODAY = "not supported (6ec689c has no FSDP support: rank 0 would save only its own shards)"


@dataclass
class DistRow:
    path: str  # "today" or "new"
    mode: str
    ranks: int
    error: str | None = None
    parameters: int = 0
    checkpoint_bytes: int = 0
    stall_first: float = math.nan
    stall: float = math.nan
    manager_blocking: float = math.nan
    sync_seconds: float = math.nan
    commit_seconds: float = math.nan
    restore_seconds: float = math.nan
    bytes_read: int = 0
    """Summed over ranks: bytes read on restore from the files of the checkpoint restored."""
    other_read: dict[str, int] = field(default_factory=dict)
    """Summed over ranks: bytes read on restore from other files under the checkpoint root (bookkeeping)."""
    restored_bytes: int | None = None
    save_rss: int = 0
    restore_rss: int = 0
    restore_rss_growth: int = 0
    restored_ok: bool = False
    check: str = ""
    wall: dict[str, float] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.stall / self.sync_seconds


def extract_tree(ref: str, directory: Path) -> Path:
    """`ref`'s elastic/ and recipes/, as `git archive` has them, under `directory`."""
    directory.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "elastic", "recipes"], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(directory)], input=archive, check=True)
    return directory


def resolve(ref: str) -> str:
    """`ref` as a short commit hash (so the printed figures name the code they measured)."""
    result = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", f"{ref}^{{commit}}"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"checkpoint.py: error: --new-ref {ref} is not a commit of {REPO}")
    return result.stdout.strip()


def _worker_error(text: str) -> str:
    """The last exception line a worker printed (its traceback's end), else the output's last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception|Exit)\b", line)
              and "ChildFailedError" not in line]
    return errors[-1] if errors else (lines[-1] if lines else "no output")


def launch(tree: Path, phase: str, row: DistRow, ckpt_dir: Path, out: Path, opts: argparse.Namespace) -> float:
    """One torchrun job of `row.ranks` workers importing `elastic` from `tree`; its wall seconds."""
    cfg = DIST_MODELS[opts.dist_model]
    threads = opts.dist_threads or max(1, (os.cpu_count() or 1) // row.ranks)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={row.ranks}",
        "--max-restarts=0", str(WORKER), "--phase", phase, "--mode", row.mode, "--ckpt-dir", str(ckpt_dir),
        "--out", str(out), "--n-layer", str(cfg.n_layer), "--n-head", str(cfg.n_head), "--n-embd", str(cfg.n_embd),
        "--block-size", str(cfg.block_size), "--context", str(min(opts.dist_context, cfg.block_size)),
        "--batch-size", str(opts.dist_batch_size), "--saves", str(opts.dist_saves), "--every", str(opts.dist_every),
        "--repeats", str(opts.dist_repeats), "--seed", str(opts.seed), "--threads", str(threads),
    ]
    env = {k: v for k, v in os.environ.items()
           if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHREVIVE_PRELOAD"}}
    env.update(PYTHONPATH=str(tree), OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    os.sync()  # the previous job's writeback is not this one's cost (untimed)
    for _attempt in range(3):
        started = time.perf_counter()
        try:
            result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=opts.dist_timeout, cwd=out)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{phase} job did not finish within {opts.dist_timeout} s (--dist-timeout)") from None
        seconds = time.perf_counter() - started
        # `--standalone` frees the port it picked before its store binds it: another process on a busy
        # machine may take it first. Nothing ran yet (the store comes before any worker): start again.
        if result.returncode == 0 or "EADDRINUSE" not in result.stdout + result.stderr:
            break
    if result.returncode != 0:
        text = result.stdout + result.stderr
        killed = "SIGKILL" in text or "exitcode  : -9" in text
        why = "killed (out of memory?)" if killed else f"exit {result.returncode}"
        log = Path(tempfile.mkstemp(prefix=f"elastic-ckpt-{row.path}-{row.mode}-{row.ranks}-{phase}-", suffix=".log",
                                    dir=opts.dir)[1])
        log.write_text(text, encoding="utf-8")
        raise RuntimeError(f"{phase} job failed, {why}: {_worker_error(text)} (whole output: {log})")
    return seconds


def _results(out: Path, phase: str, ranks: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"{phase}_rank{r}.json").read_text(encoding="utf-8")) for r in range(ranks)]


def _same(a: dict[str, list[float]], b: dict[str, list[float]]) -> str:
    """'ok' when both fingerprints agree, else the first key that differs."""
    if set(a) != set(b):
        return f"keys differ: {sorted(set(a) ^ set(b))[:3]}"
    for key in sorted(a):
        if not all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12) for x, y in zip(a[key], b[key])):
            return f"{key}: saved sum/sumsq {a[key]}, restored {b[key]}"
    return "ok"


def measure_dist(row: DistRow, tree: Path, scratch: Path, opts: argparse.Namespace) -> DistRow:
    """Save job then restore job (fresh processes, as after a restart) for one row."""
    work = scratch / f"{row.path}-{row.mode}-{row.ranks}"
    ckpt_dir, out = work / "ckpt", work / "out"
    out.mkdir(parents=True)
    try:
        row.wall["save"] = launch(tree, "save", row, ckpt_dir, out, opts)
        save = _results(out, "save", row.ranks)
        row.wall["restore"] = launch(tree, "restore", row, ckpt_dir, out, opts)
        restore = _results(out, "restore", row.ranks)
    except RuntimeError as exc:
        row.error = str(exc)
        return row
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    return row_figures(row, tree, save, restore)


def row_figures(row: DistRow, tree: Path, save: list[dict[str, Any]], restore: list[dict[str, Any]]) -> DistRow:
    """`row`'s figures from what the save job's and the restore job's ranks wrote (checkpoint_worker.py's
    `--out` files, by rank): the stall of each save as its slowest rank's, medians over the steady saves,
    bytes read inside and outside the restored checkpoint summed over ranks, the restored state's check."""
    for r in (*save, *restore):
        if not r["tree"] == str(tree):
            raise RuntimeError(f"rank {r['rank']} imported elastic from {r['tree']}, not {tree}")
    main = save[0]
    steps = sorted(int(s) for s in main["calls"])
    stall = {s: max(r["calls"][str(s)] + r["hook_wait"].get(str(s), 0.0) for r in save) for s in steps}
    steady = steps[1:] or steps
    history = {int(h["step"]): h for h in main["history"]}
    row.parameters = main["parameters"]
    row.stall_first = stall[steps[0]]
    row.stall = statistics.median(stall[s] for s in steady)
    row.manager_blocking = statistics.median(history[s]["blocking_seconds"] for s in steady if s in history)
    row.commit_seconds = statistics.median(history[s]["seconds"] for s in steady if s in history)
    row.sync_seconds = statistics.median(main["sync_seconds"])
    row.restore_seconds = max(r["seconds"] for r in restore)
    row.checkpoint_bytes = restore[0]["checkpoint_bytes"]
    inside = f"step_{restore[0]['step']:08d}{os.sep}"  # elastic._shared.storage.manifest.checkpoint_name, both trees
    for r in restore:
        for name, n in r["bytes_read"].items():
            if name.startswith(inside):
                row.bytes_read += n
            else:
                row.other_read[name] = row.other_read.get(name, 0) + n
    if restore[0]["restored_bytes"] is not None:
        row.restored_bytes = sum(r["restored_bytes"] for r in restore)
    row.save_rss = sum(r["peak_rss"] for r in save)
    row.restore_rss = sum(r["peak_rss"] for r in restore)
    row.restore_rss_growth = sum(max(0, r["peak_rss"] - r["rss_before"]) for r in restore)
    if restore[0]["step"] != main["final_step"]:
        row.check = f"restored step {restore[0]['step']}, saved {main['final_step']}"
    else:
        row.check = _same(main["fingerprint"], restore[0]["fingerprint"])
    row.restored_ok = row.check == "ok"
    return row


def compare(opts: argparse.Namespace) -> list[DistRow]:
    scratch = Path(tempfile.mkdtemp(prefix="elastic-ckpt-dist-", dir=opts.dir))
    rows: list[DistRow] = []
    cfg = DIST_MODELS[opts.dist_model]
    try:
        today = extract_tree(TODAY, scratch / "today-tree")
        if opts.new_ref == "worktree":
            new, new_name = REPO, f"{REPO} as checked out"
        else:
            commit = resolve(opts.new_ref)
            new, new_name = extract_tree(commit, scratch / "new-tree"), f"{commit}'s tree"
        print(
            f"ranks: {opts.dist_model} GPT ({cfg.n_layer} layers x {cfg.n_embd}), gloo on CPU, torchrun; "
            f"context {min(opts.dist_context, cfg.block_size)} x batch {opts.dist_batch_size} per rank; "
            f"{opts.dist_saves} saves every {opts.dist_every} steps; today = {TODAY}'s tree, new = {new_name} "
            f"(PYTHONPATH); {os.cpu_count()} cores",
            flush=True,
        )
        for ranks in opts.ranks:
            for mode in opts.modes:
                for path in ("today", "new"):
                    row = DistRow(path, mode, ranks)
                    if path == "today" and mode == "fsdp":
                        row.error = FSDP_TODAY
                    else:
                        started = time.perf_counter()
                        measure_dist(row, today if path == "today" else new, scratch, opts)
                        print(f"  {path} {mode} x{ranks}: {time.perf_counter() - started:.0f} s"
                              + (f" ({row.error})" if row.error else ""), flush=True)
                    rows.append(row)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return rows


def report_dist(rows: list[DistRow]) -> None:
    mb = lambda n: f"{n / 1e6:.1f}"  # noqa: E731
    header = ("path", "mode", "ranks", "ckpt MB", "stall s", "sync s", "ratio", "commit s", "restore s",
              "read MB", "read/ckpt", "save RSS MB", "restore RSS MB", "restored")
    table: list[tuple[str, ...]] = []
    notes: list[str] = []
    for r in rows:
        if r.error is not None:
            notes.append(f"{r.path} {r.mode} {r.ranks}: {r.error}")
            table.append((r.path, r.mode, str(r.ranks), r.error if r.error == FSDP_TODAY else "FAILED (below)"))
            continue
        table.append((
            r.path, r.mode, str(r.ranks), mb(r.checkpoint_bytes), f"{r.stall:.5f}", f"{r.sync_seconds:.4f}",
            f"{r.ratio:.4f}", f"{r.commit_seconds:.2f}", f"{r.restore_seconds:.2f}", mb(r.bytes_read),
            f"{r.bytes_read / r.checkpoint_bytes:.2f}x", mb(r.save_rss), mb(r.restore_rss),
            "ok" if r.restored_ok else "MISMATCH",
        ))
    widths = [max(len(row[i]) for row in (header, *table) if i < len(row) and len(row) == len(header))
              for i in range(len(header))]
    for row in (header, *table):
        if len(row) < len(header):  # "not supported" / failed: the message spans the measured columns
            print("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3])
        else:
            print("  ".join(cell.ljust(w) if i < 3 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))
    for r in rows:
        if r.error is not None:
            continue
        manager = f"; the manager's restored_bytes {r.restored_bytes}" if r.restored_bytes is not None else ""
        if r.other_read:
            manager += "; besides, " + ", ".join(f"{n} bytes of {name}" for name, n in sorted(r.other_read.items()))
        print(
            f"{r.path} {r.mode} {r.ranks}: restore read {r.bytes_read} bytes over {r.ranks} ranks, checkpoint "
            f"{r.checkpoint_bytes} bytes ({r.bytes_read / r.checkpoint_bytes:.3f}x){manager}; first save stalled "
            f"{r.stall_first:.5f} s; rank 0's manager blocking_seconds {r.manager_blocking:.5f} s (steady); "
            f"restore grew RSS by {mb(r.restore_rss_growth)} MB; {r.parameters / 1e6:.2f}M params; "
            f"jobs {r.wall.get('save', 0):.0f} s + {r.wall.get('restore', 0):.0f} s"
        )
        if not r.restored_ok:
            print(f"{r.path} {r.mode} {r.ranks}: restored state differs from the saved one: {r.check}")
    for note in notes:
        if not note.endswith(FSDP_TODAY):
            print(note)


def fill_defaults(opts: argparse.Namespace) -> argparse.Namespace:
    """The options left unset, as the full run or `--quick` has them (the flags given win)."""
    quick = opts.quick
    opts.configs = opts.configs or ("none" if quick else "both")
    opts.ranks = opts.ranks if opts.ranks is not None else ([1, 2] if quick else [1, 2, 4])
    opts.dist_model = opts.dist_model or ("recipe" if quick else "100m")
    opts.dist_saves = opts.dist_saves or (2 if quick else 3)
    opts.dist_repeats = opts.dist_repeats or (1 if quick else 3)
    opts.dist_context = opts.dist_context or (32 if quick else 64)
    return opts


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    opts = parser.parse_args(argv)
    if opts.dir is not None and not os.path.isdir(opts.dir):
        parser.error(f"--dir {opts.dir} is not a directory")
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    fill_defaults(opts)
    names = {"both": ["recipe", "100m"], "none": []}.get(opts.configs, [opts.configs])
    results: list[Result] = []
    rows: list[DistRow] = []
    if names:
        ctx = init_worker("cpu", environ={})  # one process, no process group
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
    if opts.ranks:
        rows = compare(opts)
        report_dist(rows)
    if opts.json:
        write_result(opts.json, "checkpoint", {
            "every": opts.every, "tiny": opts.tiny,
            "configs": {r.name: {**asdict(r), "ratio": r.ratio} for r in results},
            "ranks": [asdict(row) for row in rows]})
        print(f"results: {opts.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
