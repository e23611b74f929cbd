"""Runtime overhead: steps/s of recipes/gpt.py versus a plain seed-style DDP loop.

    python benchmarks/overhead.py      # 2 ranks on CPU: the loops' steps/s, their ratios and 95% CIs
    python benchmarks/overhead.py --warm-vs-cold   # 2 workers on one node started warm and cold (warm_cold.py)

Four loops share one `torchrun --standalone` job: the recipe's own `train()`
as `torchrevive-run` runs it, with metrics on and in-memory snapshots at
`--snapshot-every` (default auto, the runtime's default: as often as 1 % of
the loop buys, every step at the recipe's default size, at most `--ckpt-every`)
(elastic sampler, event log, progress, deferred loss read-out, the step vote,
the snapshots into shared memory, async checkpoints every `--ckpt-every`
steps, /metrics served and scraped), the same recipe with metrics off (snapshots on), the same recipe
with snapshots off (metrics on), and the loop of the PyTorch DDP tutorial
(DistributedSampler + DataLoader, forward, backward, step). Model, data,
per-rank batch and optimizer update (AdamW, warmup-cosine LR, gradient
clipping at 1.0) are the same, so the ratio isolates what the runtime adds.
Target: the recipe in the runtime's default settings (the loop with metrics
off, as --metrics-port defaults to; snapshots at their default) / DDP loop
>= 0.99 with the 95 % interval above 0.98, and the same with metrics served
and scraped; the ratio with snapshots off is printed beside it, and the
runtime's own account of its per-step time (`Run.step_costs`, phase by
phase) beside the end-to-end gap, and a snapshot's cost two ways (overhead_snapshots.py).
`--snapshot-every 1`: snapshots at every step; 0: no loop without them. `--json FILE`
writes the figures with their provenance, loop_overhead for `goodput_at_scale.py --measured`.

Snapshots need a snapshot keeper on the node, which `torchrevive-run` starts
in its agent. This benchmark launches stock torchrun (`python -m
torch.distributed.run`: the same agent, without our launcher's warm starts,
which would only change the workers' start, untimed here) and starts the
keepers itself, in the benchmark's process, before the agent: one per
recipe loop with snapshots, since the loops of one worker share a run id and
a keeper hands a restore every part of its run id (one loop would restore
another's snapshot at its start). Each loop's thread puts its keeper's
address in the environment before it builds its run, in its own first turn.

Design: the loops take turns step by step inside four whole runs. Whole runs
in turn cannot resolve 1 % on a busy 2-core machine: its speed wanders by tens
of per cent within seconds (other jobs starting and stopping), so two loops run
a minute apart see different machines. Short runs in turn would pay a run's
start (model, DDP, restore, first step) per turn. Instead each loop is ONE run
of `--warmup` + `--blocks` x `--block-steps` steps + 1, and each worker runs the
four in threads (the recipe with metrics in the main thread, as users run it;
the others in helper threads) that pass one baton: only its holder runs,
the others wait on a condition variable. The recipe is not modified: it takes
one `train_set.batch()` per step, so the benchmark hands it a `train_set`
whose `batch()` first calls a gate; the baseline calls the same gate at the top
of its step. The gate clocks the step that just ended (the wait for the baton
is no step's time) and, at the end of the loop's turn, passes the baton on.
After the untimed warmup turns (a run's start, `--warmup` steps), the loops
take turns of ONE step, in a fresh order every round (each group of 24 rounds
runs the 24 orders, shuffled), so a change of machine speed hits all four
alike. The runs' ends (final save, flush, replica check) come after the last
timed step. Every rank follows the same schedule, so their collectives match.

Honesty: what a run does in the background must be charged to that run, not
to the loop that holds the baton next. (0) Snapshots: at the end of each of
its turns, a loop with snapshots waits for its newest snapshot to be written
(the copy into shared memory, checksums, header), and that wait counts in
the turn's last step: with turns of one step, every step pays its whole
snapshot, as if the snapshot thread never overlapped the loop (an upper
bound; on 2 cores with a rank per core it hardly can). The waits are printed,
and not charged to the snapshots' own costs, which count the write's CPU.
(1) Checkpoints: a turn in which a save
starts lasts `--save-hold` steps more, so the save's writer thread runs during
its own run's steps; every loop keeps the same pattern of turn lengths (a
block starts one step before a save: the warmup is rounded up to that), and
the benchmark checks from the event logs that every save started and committed
within one turn of its own loop, and prints how many did not. (2) Metrics: the
benchmark scrapes every worker's /metrics every `--scrape-interval` seconds
(far more often than Prometheus' usual 15 s), from its own process, as a
Prometheus on the machine would, but only while a recipe with metrics (with
or without snapshots: each serves on a port block of its own) holds the baton
in a timed turn (the worker raises that loop's flag file, which the scraper
reads), so the scraping is charged to that recipe alone.

(3) The replica checks' `auto` interval: a run measures its step as the wall
time between step ends, which here would hold the other loops' turns too (four
times its own step), and pick checks four times too often. Each loop's thread
reads a clock that stops while its loop waits for the baton (the gate's
waits), as its wall clock would run in a job of its own.

Statistics: steps are grouped in blocks of `--block-steps` steps per loop
(10; the timed steps hold whole `--ckpt-every` intervals, the runtime's 50 by
default, so one block in five of a recipe holds a save); the loops' blocks are
interleaved over the same few seconds. Per block and
loop, steps/s as 1 / median step time (robust to the odd step slowed by another
process) and as steps / seconds (every step counts, checkpoint steps too). The
block's ratio recipe / baseline is a paired measurement. The ratio printed is
the geometric mean of the paired block ratios (the steps/s printed are the
geometric means of the per-block figures, so X / Y = ratio) with a 95 %
Student-t confidence interval over the blocks' log ratios (a paired t-interval,
exponentiated). The verdict says whether the whole interval clears the target.
What pairing cannot remove is load that changes within a step: under heavy
load only more `--blocks` narrow the interval, or fewer neighbours (e.g.
`nice -n -10 python benchmarks/overhead.py`: the whole tree, scraper included,
inherits the priority, so every loop and the scraping keep their shares).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings, by plain name
from overhead_snapshots import figures as snapshot_figures, lines as snapshot_lines, summarize as summarize_snapshots  # noqa: E402, I001
from provenance import write_result  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LOOPS = ("recipe", "recipe_no_metrics", "recipe_no_snapshots", "baseline")
SNAPSHOTTING = ("recipe", "recipe_no_metrics")
SCRAPED = ("recipe", "recipe_no_snapshots")  # metrics on: their /metrics are scraped in their timed turns
TARGET = 0.99  # the ratio ...
FLOOR = 0.98  # ... with its whole 95 % interval above this


def loops(opts: argparse.Namespace) -> tuple[str, ...]:
    """The loops this run has: without snapshots anywhere, no loop is there to compare them with."""
    return LOOPS if opts.snapshot_every else tuple(name for name in LOOPS if name != "recipe_no_snapshots")


def recipe_api() -> SimpleNamespace:
    """Everything taken from recipes/gpt.py, in one place (switch here when its API moves):
    parse(argv) -> args; data(args) -> (train_set, val_set); train(args, train_set, val_set) -> summary;
    build(args) -> (model, optimizer, scheduler) built as the recipe builds them, for the baseline."""
    import torch

    sys.path.insert(0, str(REPO / "recipes"))
    import gpt  # the recipe itself, not a copy

    corpus = gpt.load_corpus(None)

    def build(args: argparse.Namespace) -> tuple:
        torch.manual_seed(args.seed)
        model = gpt.GPT(gpt.model_config(args))
        optimizer = gpt.configure_optimizer(model, lr=args.lr, weight_decay=args.weight_decay)
        warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.max_steps // 20)
        schedule = gpt.WarmupCosine(warmup, args.max_steps, args.min_lr_ratio)
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    return SimpleNamespace(
        parse=lambda argv: gpt.build_parser().parse_args(argv),
        data=lambda args: gpt.split_corpus(corpus, block_size=args.block_size),
        train=gpt.train,  # elastic.Run inside adopts the worker's process group and leaves it up
        build=build,
    )


def snapshot_setting(text: str) -> str | int:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not auto or a number of steps") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be 0 or more")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="worker processes (one torchrun agent)")
    p.add_argument("--blocks", type=int, default=30, help="timed blocks per loop (paired ratios)")
    p.add_argument("--block-steps", type=int, default=None,
                   help="steps per block (default: 10, or --ckpt-every when that is smaller)")
    p.add_argument("--warmup", type=int, default=19,
                   help="untimed steps at the start of each run (rounded up to end one step before a checkpoint)")
    p.add_argument("--save-hold", type=int, default=3,
                   help="steps a loop keeps the CPU after its checkpoint save starts (its writer's time is its own)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--ckpt-every", type=int, default=50,
                   help="recipe checkpoint interval (0: no checkpoints; default: the runtime's own)")
    p.add_argument("--snapshot-every", type=snapshot_setting, default="auto",
                   help="in-memory snapshots of the recipe loops that take them: auto (the runtime's default), "
                        "N steps, or 0 (none)")
    p.add_argument("--json", default=None,
                   help="write the figures here with their provenance (loop_overhead: 1 - the end-to-end ratio, for "
                        "goodput_at_scale.py --measured; the snapshots' costs)")
    p.add_argument("--metrics-port", type=int, default=None, help="base port of the workers' /metrics (default: a free one)")
    p.add_argument("--scrape-interval", type=float, default=1.0, help="seconds between scrapes of each worker")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--scrape-flag", default=None, help=argparse.SUPPRESS)
    p.add_argument("--keepers", default="{}", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.ckpt_every < 0:
        p.error("--ckpt-every must be 0 or more")
    if opts.block_steps is None:
        opts.block_steps = min(10, opts.ckpt_every) if opts.ckpt_every else 10
    if opts.blocks < 2:
        p.error("--blocks must be at least 2 (a confidence interval needs two paired ratios)")
    if opts.warmup < 1 or opts.block_steps < 2 or opts.save_hold < 0:
        p.error("--warmup must be at least 1 (the first step is never timed), --block-steps at least 2, --save-hold >= 0")
    if opts.ckpt_every and (opts.block_steps * opts.blocks) % opts.ckpt_every:
        p.error("--blocks x --block-steps must be a multiple of --ckpt-every (the timed steps hold whole checkpoint "
                "intervals, so every loop sees the same saves)")
    if opts.ckpt_every:  # the timed steps start one step before a save: the save's turn opens each interval
        opts.warmup += -(opts.warmup + 1) % opts.ckpt_every
    return opts


def recipe_args(
    opts: argparse.Namespace, max_steps: int, events: str, ckpt_dir: str, metrics_port: int,
    snapshot_every: int | str = 0,
) -> list[str]:
    # Snapshots need a checkpoint directory (the keeper persists them there); with --ckpt-every 0 it
    # gets only the final checkpoint.
    ckpt = ["--ckpt-dir", ckpt_dir, "--ckpt-every", str(opts.ckpt_every)] if opts.ckpt_every or snapshot_every else []
    return [
        "--max-steps", str(max_steps), "--batch-size", str(opts.batch_size),
        "--eval-every", "0", "--sample-tokens", "0", "--events", events, "--device", "cpu",
        "--metrics-port", str(metrics_port), "--snapshot-every", str(snapshot_every), *ckpt,
    ]


def turn_lengths(opts: argparse.Namespace) -> list[int]:
    """Steps per turn within one checkpoint interval (or one block without checkpoints), the same for every
    loop: one step each, except that the turn in which a checkpoint save starts runs `--save-hold` steps
    more, so its writer runs on its own loop's time."""
    if not opts.ckpt_every:
        return [1] * opts.block_steps
    hold = min(opts.save_hold, opts.ckpt_every - 1)
    # The timed steps start one step before a save (see parse_args): the save's turn comes first.
    return [1 + hold] + [1] * (opts.ckpt_every - 1 - hold)


def turn_ends(opts: argparse.Namespace) -> list[int]:
    """The step counts at which a loop hands the baton on: after the warmup, then after every turn."""
    ends = [opts.warmup]
    period = opts.ckpt_every or opts.block_steps
    for _ in range(opts.blocks * opts.block_steps // period):
        for length in turn_lengths(opts):
            ends.append(ends[-1] + length)
    return ends


def turn_order(rounds: int, seed: int = 0, names: tuple[str, ...] = LOOPS) -> list[str]:
    """Who goes when in each round (one turn per loop): each group of n! rounds runs the n! orders, shuffled."""
    rng = random.Random(seed)  # the same on every rank: their collectives must match
    order: list[str] = []
    while len(order) < rounds * len(names):
        group = list(itertools.permutations(names))
        rng.shuffle(group)
        order += [name for perm in group for name in perm]
    return order[: rounds * len(names)]


class Turns:
    """One baton for the loops' threads, handed on in a fixed schedule of turns: only its holder runs."""

    def __init__(self, schedule: list[str]) -> None:
        self.schedule, self.at = schedule, 0
        self.walls: list[tuple[str, float, float]] = []  # (loop, start, end) per turn, wall clock
        self._started = 0.0
        self._cond = threading.Condition()

    def wait(self, name: str) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.at < len(self.schedule) and self.schedule[self.at] == name)
        self._started = time.time()

    def done(self, name: str) -> None:
        self.walls.append((name, self._started, time.time()))
        with self._cond:
            assert self.schedule[self.at] == name, (self.schedule[self.at], name)
            self.at += 1
            self._cond.notify_all()


class Gate:
    """Called at the top of every step of one loop: clocks the step that just ended and, at the end of
    the loop's turn, hands the baton on and waits for the next. Steps between the first and the last
    turn end are timed, `block_steps` to a block."""

    def __init__(
        self, name: str, turns: Turns, ends: list[int], block_steps: int,
        on_timed_turn: Callable[[bool], None] | None = None, drain: Callable[[], None] | None = None,
    ) -> None:
        self.name, self.turns, self.ends, self.block_steps = name, turns, ends, block_steps
        self.on_timed_turn = on_timed_turn
        self.drain = drain  # at a turn's end: wait for this loop's background snapshot work
        self.drained: list[float] = []  # seconds drain() waited at the end of each timed turn
        self.count = 0  # steps this loop has completed
        self.timed: list[list[float]] = []  # per block: the seconds of each of its steps
        self._at = 0  # index of the next turn end in `ends`
        self._step_started = 0.0
        self._thread: int | None = None
        self.waited = 0.0
        """Seconds this loop has waited for the baton (its own clock stops meanwhile: `own_clock`)."""

    @property
    def max_steps(self) -> int:
        return self.ends[-1] + 1  # the last timed turn ends at a step's top: one more step, then the run's end

    def __call__(self) -> None:
        if self.drain is not None and self._at < len(self.ends) and self.count == self.ends[self._at]:
            started = time.perf_counter()  # the turn ends here: its snapshot work is its own step's time
            self.drain()
            if 0 < self._at:
                self.drained.append(time.perf_counter() - started)
        now = time.perf_counter()
        if self._thread is None:
            self._thread = threading.get_ident()
        elif self._thread != threading.get_ident():
            raise RuntimeError(f"{self.name}: steps taken on two threads; the gate needs one call per step, in the loop")
        timing = 0 < self._at < len(self.ends)
        if timing:  # the step that just ended
            if not self.timed or len(self.timed[-1]) == self.block_steps:
                self.timed.append([])
            self.timed[-1].append(now - self._step_started)
        self._step_started = now
        done, self.count = self.count, self.count + 1
        if done != self.ends[self._at]:
            return
        if timing and self.on_timed_turn is not None:
            self.on_timed_turn(False)
        waiting = time.monotonic()
        self.turns.done(self.name)
        self.turns.wait(self.name)
        self.waited += time.monotonic() - waiting
        self._at += 1
        if 0 < self._at < len(self.ends) and self.on_timed_turn is not None:
            self.on_timed_turn(True)
        self._step_started = time.perf_counter()  # the wait is no step's time

    def finish(self) -> None:
        """The loop's run returned: check it took all its steps through the gate, end its last turn."""
        if self.count != self.max_steps or self._at != len(self.ends):
            raise RuntimeError(
                f"{self.name}: the gate saw {self.count} steps, expected {self.max_steps}: "
                "the loop no longer takes one batch per step"
            )
        self.turns.done(self.name)


class GatedWindows:
    """The recipe's training windows, gated: the recipe takes one `batch()` at the top of each step."""

    def __init__(self, windows, gate: Gate) -> None:
        self._windows, self._gate = windows, gate

    def __len__(self) -> int:
        return len(self._windows)

    def batch(self, indices):
        self._gate()
        return self._windows.batch(indices)

    def __getattr__(self, name: str):
        return getattr(self._windows, name)


def run_baseline(api: SimpleNamespace, args: argparse.Namespace, ctx, train_set, gate: Gate) -> None:
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

    model, optimizer, scheduler = api.build(args)
    model = DDP(model)
    dataset = Windows()
    sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    steps, epoch = 0, 0
    while steps < args.max_steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            gate()
            _, loss = model(x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            scheduler.step()
            steps += 1
            if steps == args.max_steps:
                break
        epoch += 1


def in_turn(turns: Turns, gate: Gate, run: Callable[[], None]) -> None:
    turns.wait(gate.name)
    run()
    gate.finish()


def in_thread(turns: Turns, gate: Gate, run: Callable[[], None]) -> threading.Thread:
    def target() -> None:
        try:
            in_turn(turns, gate, run)
        except BaseException:  # noqa: BLE001 - the baton would never come back: end the worker, torchrun ends the job
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)

    return threading.Thread(target=target, name=f"overhead-{gate.name}", daemon=True)


def track_snapshots() -> dict[int, list]:
    """Every `MemorySnapshots` this process builds from now on, by the thread that built it (each
    loop builds its run, and so its snapshots, in its own thread)."""
    from elastic._worker.checkpoint import memory

    built: dict[int, list] = {}
    original = memory.MemorySnapshots.__init__

    def init(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        built.setdefault(threading.get_ident(), []).append(self)

    memory.MemorySnapshots.__init__ = init
    return built


def worker(opts: argparse.Namespace) -> None:
    from elastic._worker.integrity import check_interval
    from elastic._worker.observe.events import read_events
    from elastic._worker.runtime.context import barrier, worker_context

    keepers: dict[str, dict[str, str]] = json.loads(opts.keepers)
    snapshots = track_snapshots()
    names = loops(opts)

    def drain() -> None:  # the calling loop's snapshot in flight, written (charged by the gate, not by the runtime)
        for memory in snapshots.get(threading.get_ident(), []):
            memory.wait_previous(charge=False)

    with worker_context("cpu") as ctx, tempfile.TemporaryDirectory() as tmp:
        api = recipe_api()

        def scraper_flag(name: str) -> Callable[[bool], None] | None:
            """The loop with metrics is scraped during its own timed turns only."""
            if not (opts.scrape_flag and ctx.is_main) or name not in SCRAPED:
                return None
            flag = Path(f"{opts.scrape_flag}.{name}")

            def scrape(timing: bool) -> None:
                if timing:
                    flag.touch()
                else:
                    flag.unlink(missing_ok=True)

            return scrape

        summaries: dict[str, dict[str, Any]] = {}
        ends = turn_ends(opts)
        turns = Turns([*names, *turn_order(len(ends) - 1, names=names), *names])  # warmup turns, rounds, the runs' ends
        gates = {
            name: Gate(name, turns, ends, opts.block_steps, scraper_flag(name),
                       drain if name in SNAPSHOTTING and opts.snapshot_every else None)
            for name in names
        }
        max_steps = gates["recipe"].max_steps
        by_thread: dict[int, Gate] = {}

        def own_clock() -> float:
            """Monotonic seconds less the baton waits of the calling loop (see the module docstring, (3))."""
            gate = by_thread.get(threading.get_ident())
            return time.monotonic() - (gate.waited if gate is not None else 0.0)

        check_interval.now = own_clock  # type: ignore[assignment]

        def events(name: str) -> str:
            return os.path.join(tmp, f"{name}.jsonl")

        def args_for(name: str, metrics_port: int) -> argparse.Namespace:
            every = opts.snapshot_every if name in SNAPSHOTTING else 0
            return api.parse(
                recipe_args(opts, max_steps, events(name), os.path.join(tmp, f"ckpt-{name}"), metrics_port, every)
            )

        def recipe(name: str, metrics_port: int) -> None:
            by_thread[threading.get_ident()] = gates[name]
            # This loop's keeper (or none): read once, when the run builds its checkpoint manager, in
            # this loop's first turn, while every other loop waits for the baton.
            for key in {k for env in keepers.values() for k in env}:
                os.environ.pop(key, None)
            os.environ.update(keepers.get(name, {}))
            args = args_for(name, metrics_port)
            train_set, val_set = api.data(args)
            summary = api.train(args, GatedWindows(train_set, gates[name]), val_set)
            if summary["step"] != max_steps:
                raise RuntimeError(f"{name}: the recipe ended at step {summary['step']}, not {max_steps}")
            summaries[name] = summary

        def baseline() -> None:
            args = args_for("baseline", 0)
            run_baseline(api, args, ctx, api.data(args)[0], gates["baseline"])

        helpers = [in_thread(turns, gates["recipe_no_metrics"], lambda: recipe("recipe_no_metrics", 0))]
        if "recipe_no_snapshots" in names:
            port = opts.metrics_port + opts.ranks  # a port block of its own
            helpers.append(in_thread(turns, gates["recipe_no_snapshots"], lambda: recipe("recipe_no_snapshots", port)))
        helpers.append(in_thread(turns, gates["baseline"], baseline))
        for thread in helpers:
            thread.start()
        barrier(ctx)
        in_turn(turns, gates["recipe"], lambda: recipe("recipe", opts.metrics_port))
        for thread in helpers:
            thread.join()
        if ctx.is_main and opts.out:
            commits = {
                name: [(e["time"] - e["seconds"], e["time"]) for e in read_events(events(name)) if e["event"] == "checkpoint"]
                for name in names if name != "baseline"
            }
            taken = {gate.name: summarize_snapshots(snapshots.get(gate._thread, []))
                     for gate in gates.values() if gate.name in SNAPSHOTTING}
            results = {
                "timed": {name: gates[name].timed for name in names}, "turns": turns.walls, "commits": commits,
                "snapshots": taken, "drained": {name: gates[name].drained for name in names},
                "costs": {name: summary["step_costs"] for name, summary in summaries.items()},
                "intervals": {
                    gate.name: [m.every for m in snapshots.get(gate._thread, [])]
                    for gate in gates.values() if gate.name in SNAPSHOTTING
                },
            }
            Path(opts.out).write_text(json.dumps(results))


def block_rates(steps: list[float]) -> tuple[float, float]:
    """A block's steps/s from the seconds of its steps: (1 / median step, steps / seconds)."""
    return 1.0 / statistics.median(steps), len(steps) / math.fsum(steps)


def t_quantile(p: float, df: int) -> float:
    """Student-t quantile (two-sided coverage 2p - 1) by bisection on its exact CDF for integer df
    (Abramowitz & Stegun 26.7.3-4), so no SciPy is needed."""

    def coverage(t: float) -> float:  # P(|T| <= t)
        theta = math.atan(t / math.sqrt(df))
        s, c = math.sin(theta), math.cos(theta)
        total = term = c if df % 2 else 1.0
        for k in range(3 if df % 2 else 2, df - 1, 2):
            term *= c * c * (k - 1) / k
            total += term
        if df % 2:
            return 2 / math.pi * (theta + (s * total if df > 1 else 0.0))
        return s * total

    lo, hi = 0.0, 1e4
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if coverage(mid) < 2 * p - 1 else (lo, mid)
    return (lo + hi) / 2


def geometric_mean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def paired_ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Geometric mean of the paired ratios a_i / b_i and its 95 % t-interval (over the log ratios)."""
    logs = [math.log(x / y) for x, y in zip(a, b, strict=True)]
    mean, half = statistics.fmean(logs), t_quantile(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def blocks_to_resolve(a: list[float], b: list[float], resolution: float = 0.01) -> int:
    """Blocks that would narrow the 95 % interval to +-`resolution` at the spread these blocks show."""
    spread = statistics.stdev(math.log(x / y) for x, y in zip(a, b, strict=True))
    return max(2, math.ceil((1.96 * spread / math.log1p(resolution)) ** 2))


def ratio_text(ratio: tuple[float, float, float]) -> str:
    return f"{ratio[0]:.3f} [95% CI {ratio[1]:.3f}-{ratio[2]:.3f}]"


def verdict(ratio: tuple[float, float, float]) -> str:
    if ratio[0] >= TARGET and ratio[1] >= FLOOR:
        return "met"
    if ratio[0] < TARGET:
        return f"MISSED (the ratio is below {TARGET})"
    return f"not resolved (the interval reaches below {FLOOR}: more --blocks)"


def spilled_saves(saves: list[tuple[float, float]], turns: list[tuple[str, float, float]], name: str) -> int:
    """Saves not started and committed within one turn of their own loop: their writer ran on another's time."""
    own = [(start, end) for loop, start, end in turns if loop == name]
    return sum(not any(start <= began and committed <= end for start, end in own) for began, committed in saves)


def start_keepers(opts: argparse.Namespace) -> dict[str, Any]:
    """A snapshot keeper per recipe loop with snapshots, in this process (see the module docstring)."""
    if not opts.snapshot_every:
        return {}
    from elastic._agent.launcher.keeper import SnapshotKeeper
    from elastic._shared.storage.job_secret import made_on_this_host

    keepers: dict[str, Any] = {}
    try:
        for name in SNAPSHOTTING:
            secret = made_on_this_host(f"overhead-{name}")
            key, secret_file = secret.key, secret.made_here
            keepers[name] = SnapshotKeeper("127.0.0.1", key=key, run_id=f"overhead-{name}", secret_file=secret_file)
    except BaseException:
        for keeper in keepers.values():
            keeper.close()
        raise
    return keepers


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if "--warm-vs-cold" in given:  # the workers' start instead: 2 on one node, warm against cold (warm_cold.py)
        import warm_cold
        return warm_cold.main([a for a in given if a != "--warm-vs-cold"])
    opts = parse_args(argv)
    if opts.worker:
        worker(opts)
        # The ranks left the group together and rank 0 wrote the results: end without finalizing the
        # interpreter. gloo's threads outlive the process group (DDP's import of torch.distributed.nn.functional
        # holds it), and one that drops a finished collective while the interpreter finalizes aborts the
        # process ("terminate called without an active exception"): see end_worker in control_cost.py.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    names = loops(opts)
    scraped = [name for name in SCRAPED if name in names]
    if opts.metrics_port is None:
        opts.metrics_port = free_port_block(opts.ranks * len(scraped))
    started = time.monotonic()
    keepers = start_keepers(opts)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out, flag = os.path.join(tmp, "results.json"), os.path.join(tmp, "scrape")
            hidden = {"worker", "out", "scrape_flag", "keepers"}
            forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(opts).items() if k not in hidden]
            addresses = {name: keeper.address.environ() for name, keeper in keepers.items()}
            command = [
                sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={opts.ranks}",
                __file__, "--worker", f"--out={out}", f"--scrape-flag={flag}", f"--keepers={json.dumps(addresses)}",
                *forwarded,
            ]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING"}
            ports = {
                f"{flag}.{name}": [opts.metrics_port + i * opts.ranks + r for r in range(opts.ranks)]
                for i, name in enumerate(scraped)
            }
            with Scraper(ports, opts.scrape_interval) as scraper:
                subprocess.run(command, check=True, env=env, cwd=REPO)
            results = json.loads(Path(out).read_text())
    finally:
        for keeper in keepers.values():
            keeper.close()
    seconds = time.monotonic() - started
    if scraper.scrapes == 0:
        sys.exit("overhead.py: error: no worker served /metrics: the 'metrics on' runs measured nothing of metrics")
    report(opts, results, scrapes=scraper.scrapes, refused=scraper.failures,
           scraped_by_loop={name: scraper.by_flag[f"{flag}.{name}"] for name in scraped}, seconds=seconds)
    return 0


def report(
    opts: argparse.Namespace, results: dict[str, Any], *, scrapes: int, refused: int, scraped_by_loop: dict[str, int],
    seconds: float,
) -> None:
    """Print the tables of one run from the workers' `results` (and write `--json`): per-block rates, the
    saves, the snapshots, the scrapes (`scrapes` answered and `refused`, `scraped_by_loop` per loop with
    metrics), the paired ratios with their intervals, the verdicts and the runtime's per-step costs."""
    names = loops(opts)
    rates = {name: [block_rates(steps) for steps in results["timed"][name]] for name in names}
    median_rate = {name: [r[0] for r in rates[name]] for name in names}
    mean_rate = {name: [r[1] for r in rates[name]] for name in names}
    saves_turn = f" ({turn_lengths(opts)[0]} for a save's)" if opts.ckpt_every else ""
    print(
        f"ranks={opts.ranks} batch={opts.batch_size} device=cpu: {opts.blocks} blocks of {opts.block_steps} steps "
        f"per loop after {opts.warmup} warmup steps, taken in turns of one step{saves_turn} in a shuffled order"
    )
    for name in names:
        print(f"{name:19} steps/s per block: " + " ".join(f"{v:.2f}" for v in median_rate[name]))
    if opts.ckpt_every:
        saves = sum(len(v) for v in results["commits"].values())
        spilled = sum(spilled_saves(v, results["turns"], name) for name, v in results["commits"].items())
        print(
            f"checkpoint every {opts.ckpt_every} steps: {saves} saves, "
            f"{spilled} not started and committed within one turn of their own loop"
        )
    else:
        print("no checkpoints")
    if opts.snapshot_every == "auto":
        chosen = sorted({e for name in SNAPSHOTTING for e in results["intervals"].get(name, [])})
        snapshots_label = f"snapshots auto (every {'/'.join(map(str, chosen)) or '?'} steps at the end)"
    else:
        snapshots_label = f"snapshots every {opts.snapshot_every} step{'s' if opts.snapshot_every != 1 else ''}"
    if opts.snapshot_every:
        waits = [f"{name} {statistics.median(results['drained'][name]) * 1e3:.1f} ms" if results["drained"].get(name)
                 else f"{name} -" for name in SNAPSHOTTING]
        print("snapshot work waited for at the end of each timed turn (median, counted in that turn's step): "
              + ", ".join(waits))
    else:
        print("no in-memory snapshots")
    per_loop = ", ".join(f"{name} {count}" for name, count in scraped_by_loop.items())
    print(
        f"metrics scraped {scrapes} times ({refused} refused), "
        f"every {opts.scrape_interval:g} s per worker during the timed turns of the loops with metrics ({per_loop})"
    )
    how = f"geometric mean of {opts.blocks} paired block ratios, 95% t-interval"
    for rate, label in ((median_rate, "1/median step"), (mean_rate, "steps/seconds, checkpoint steps included")):
        ratio = paired_ratio(rate["recipe"], rate["baseline"])
        print(
            f"recipe/gpt.py {geometric_mean(rate['recipe']):.3f} steps/s | seed-style DDP "
            f"{geometric_mean(rate['baseline']):.3f} steps/s | ratio {ratio_text(ratio)} "
            f"({label}; {snapshots_label if opts.snapshot_every else 'no snapshots'}; {how})"
        )
    for rate, label in ((median_rate, "1/median step"), (mean_rate, "steps/seconds, checkpoint steps included")):
        ratio = paired_ratio(rate["recipe_no_metrics"], rate["baseline"])
        print(
            f"recipe/gpt.py, default settings (metrics off) {geometric_mean(rate['recipe_no_metrics']):.3f} steps/s | "
            f"seed-style DDP {geometric_mean(rate['baseline']):.3f} steps/s | ratio {ratio_text(ratio)} ({label}; {how})"
        )
    if "recipe_no_snapshots" in names:
        for rate, label in ((median_rate, "1/median step"), (mean_rate, "steps/seconds, checkpoint steps included")):
            ratio = paired_ratio(rate["recipe_no_snapshots"], rate["baseline"])
            print(
                f"recipe/gpt.py, snapshots off {geometric_mean(rate['recipe_no_snapshots']):.3f} steps/s | seed-style "
                f"DDP {geometric_mean(rate['baseline']):.3f} steps/s | ratio {ratio_text(ratio)} ({label}; {how})"
            )
    on_off = paired_ratio(median_rate["recipe"], median_rate["recipe_no_metrics"])
    on_off_mean = paired_ratio(mean_rate["recipe"], mean_rate["recipe_no_metrics"])
    print(f"metrics on / off: {ratio_text(on_off)} (1/median step), {ratio_text(on_off_mean)} (steps/seconds)")
    snap = paired_ratio(median_rate["recipe"], median_rate["recipe_no_snapshots"]) if "recipe_no_snapshots" in names else None
    if snap is not None:
        snap_mean = paired_ratio(mean_rate["recipe"], mean_rate["recipe_no_snapshots"])
        print(f"snapshots on / off: {ratio_text(snap)} (1/median step), {ratio_text(snap_mean)} (steps/seconds)")
    plain_step = 1 / geometric_mean(median_rate["recipe_no_snapshots" if snap is not None else "baseline"])
    if opts.snapshot_every:
        for line in snapshot_lines(snapshots_label, results, SNAPSHOTTING, plain_step, snap):
            print(line)
    # The runtime's defaults: no metrics endpoint (--metrics-port 0), snapshots at --snapshot-every's default.
    default_ratio = paired_ratio(median_rate["recipe_no_metrics"], median_rate["baseline"])
    print(f"target ratio >= {TARGET}, 95% interval above {FLOOR}, default settings: {verdict(default_ratio)} "
          f"({ratio_text(default_ratio)} over {opts.blocks} blocks"
          + (f"; {snapshots_label})" if opts.snapshot_every else ")"))
    served = paired_ratio(median_rate["recipe"], median_rate["baseline"])
    print(f"target ratio >= {TARGET}, 95% interval above {FLOOR}, with metrics served and scraped: {verdict(served)} "
          f"({ratio_text(served)})")
    if "recipe_no_snapshots" in names:
        print(f"target ratio >= {TARGET}, 95% interval above {FLOOR}, with snapshots off: "
              f"{verdict(paired_ratio(median_rate['recipe_no_snapshots'], median_rate['baseline']))}")
    print_breakdown(results, median_rate, names)
    ratio = default_ratio
    if opts.json:
        write_result(opts.json, "overhead", {
            "loop_overhead": max(0.0, 1 - ratio[0]), "ratio": ratio, "snapshot_every": opts.snapshot_every,
            "snapshots": snapshot_figures(results, SNAPSHOTTING, plain_step, snap) if opts.snapshot_every else None})
        print(f"loop_overhead = 1 - {ratio[0]:.4f} (1/median step, default settings) written to {opts.json} "
              "for goodput_at_scale.py --measured, with the snapshots' figures and provenance")
    needed = blocks_to_resolve(median_rate["recipe_no_metrics"], median_rate["baseline"])
    print(
        f"took {seconds:.0f} s; at this run's spread, an interval of +-1 % needs --blocks {needed} "
        f"(about {seconds * needed / opts.blocks / 60:.0f} min)"
    )


def print_breakdown(results: dict[str, Any], median_rate: dict[str, list[float]], names: tuple[str, ...]) -> None:
    """Where the runtime's time on the loop goes (rank 0's Run.step_costs), as shares of the median step,
    beside the end-to-end gap to the seed-style loop; what the phases do not hold is printed as such."""
    from elastic._worker.observe.step_costs import PHASES

    loops = [name for name in names if name in results["costs"]]
    step = {name: 1 / geometric_mean(median_rate[name]) for name in loops}
    print("per-step cost of the runtime on the loop (rank 0, whole run, ms per step and share of the loop's median step):")
    print(f"  {'phase':14}" + "".join(f"{name:>28}" for name in loops))
    for phase in PHASES:
        cells = [results["costs"][name][phase] for name in loops]
        print(f"  {phase:14}" + "".join(f"{c * 1e3:>15.3f} ms {c / step[n]:>8.3%}" for c, n in zip(cells, loops)))
    totals = [sum(results["costs"][name].values()) for name in loops]
    print(f"  {'total':14}" + "".join(f"{t * 1e3:>15.3f} ms {t / step[n]:>8.3%}" for t, n in zip(totals, loops)))
    gaps = [1 - paired_ratio(median_rate[name], median_rate["baseline"])[0] for name in loops]
    print(f"  {'end-to-end':14}" + "".join(f"{g * step[n] * 1e3:>15.3f} ms {g:>8.3%}" for g, n in zip(gaps, loops))
          + "   (1 - ratio to the seed-style loop; noise included)")


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
    """Scrapes each worker's /metrics every `interval` seconds, as Prometheus would: the ports of a
    flag file while that file exists (its loop is in a timed turn)."""

    def __init__(self, ports: dict[str, list[int]], interval: float) -> None:
        self.ports, self.interval = ports, interval
        self.scrapes = self.failures = 0
        self.by_flag = {flag: 0 for flag in ports}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for flag, ports in self.ports.items():
                if not os.path.exists(flag):  # another loop holds the CPU: not this loop's cost
                    continue
                for port in ports:
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                            response.read()
                        self.scrapes += 1
                        self.by_flag[flag] += 1
                    except OSError:
                        self.failures += 1  # its server is down: counted, the run goes on

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


if __name__ == "__main__":
    sys.exit(main())
