"""The per-step control cost as the job grows: the step vote taken blocking at each step's end,
against the step vote started in the optimizer step (what `elastic.Run` does), against no vote.

    python benchmarks/control_cost.py                   # 2, 4 and 8 ranks on CPU (gloo), a tiny model
    python benchmarks/control_cost.py --ranks 2,4 --blocks 20

Each world size is one `torchrun --standalone` job. Every rank trains a tiny
DDP model with AdamW, as the recipes do (so each step already holds one
gradient all-reduce), in three modes that take turns block by block, in a
rotating order, over the same seconds:

- none: forward, backward, optimizer step; no vote;
- blocking: the same, then the step vote (an element-wise MAX of three ints on
  the gloo control group, `elastic._worker.control.agreement.start_max`) waited for at once at
  the step's end: the vote as it was taken before;
- pipelined: the vote as `Run` takes it (`elastic._worker.control.step_vote.StepVote`):
  started at the end of a vote step, read at the next, vote steps about a
  second apart (at most 10 steps).

Per block and mode the mean step (a vote every k steps counts as 1/k of its
cost per step); printed per world size: the mean step without a vote and
what each vote adds to it (the median over blocks of the paired per-block
differences, in microseconds and as a share of the step).
Ranks above the core count share cores (8 ranks on 2 cores): the cost then
includes waiting for a descheduled peer, which is what a vote costs there.
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
from typing import NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings, by plain name
from common import world_sizes  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODES = ("none", "blocking", "pipelined")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4,8", help="world sizes, comma-separated")
    p.add_argument("--blocks", type=int, default=30, help="blocks per mode (paired differences)")
    p.add_argument("--block-steps", type=int, default=20, help="steps per block")
    p.add_argument("--width", type=int, default=256, help="the tiny model's width (Linear width x width, twice)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    opts.world_sizes = world_sizes(p, opts.ranks, "one rank has nothing to agree with")
    if opts.blocks < 2 or opts.block_steps < 1:
        p.error("--blocks must be at least 2 and --block-steps at least 1")
    return opts


def worker(opts: argparse.Namespace) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from elastic._worker.control import agreement
    from elastic._worker.control.step_vote import Ballot, StepVote
    from elastic._worker.runtime.context import worker_context

    with worker_context("cpu") as ctx:
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(
            torch.nn.Linear(opts.width, opts.width), torch.nn.ReLU(), torch.nn.Linear(opts.width, opts.width)
        ))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # the recipes' optimizer
        vote = StepVote(ctx, Ballot, grace=15.0)  # the default --term-grace
        mode, steps = ["none"], [0]
        x = torch.randn(16, opts.width)

        def step() -> float:
            started = time.perf_counter()
            loss = model(x).square().mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if mode[0] == "blocking":
                agreement.start_max(ctx, [0, 0, 0]).result()
            elif mode[0] == "pipelined":
                steps[0] += 1
                vote.step_ended(steps[0])
            return time.perf_counter() - started

        for name in MODES:  # warm up every mode
            mode[0] = name
            for _ in range(opts.block_steps):
                step()
            vote.settle()
        means: dict[str, list[float]] = {name: [] for name in MODES}
        for block in range(opts.blocks):
            for i in range(len(MODES)):
                mode[0] = MODES[(block + i) % len(MODES)]  # the same rotation on every rank
                means[mode[0]].append(statistics.fmean(step() for _ in range(opts.block_steps)))
                vote.settle()  # the pipelined mode's last vote, read before another mode's collectives
        if ctx.is_main and opts.out:
            Path(opts.out).write_text(json.dumps(means))


def end_worker() -> NoReturn:
    """End a worker that left its group (`worker_context`: barrier, destroy_process_group) without
    finalizing the interpreter.

    The gloo process group outlives `destroy_process_group`: building DDP imports
    torch.distributed.nn.functional, whose functions take `group=group.WORLD` as a default argument,
    evaluated then, so they hold the group (and with it gloo's worker threads) until the process ends.
    A gloo worker thread drops each finished collective after the caller's `wait()` returned; the
    work's captured thread-local state holds Python objects, so that drop takes the GIL. When the
    thread is descheduled between the two (a loaded machine) and the main thread meanwhile reaches
    interpreter finalization (the last collective is the exit barrier), CPython ends the thread that
    takes the GIL with pthread_exit, whose unwind meets a noexcept destructor: "terminate called
    without an active exception", SIGABRT, exit -6, after the measurement was written. Ending with
    os._exit skips finalization, so no thread is unwound; stdout and stderr are flushed first.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def measure(opts: argparse.Namespace, world_size: int) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "means.json")
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}", __file__,
            "--worker", f"--out={out}", f"--blocks={opts.blocks}", f"--block-steps={opts.block_steps}",
            f"--width={opts.width}",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING", "PYTHONPATH": str(REPO)}
        subprocess.run(command, check=True, env=env, cwd=REPO)
        return json.loads(Path(out).read_text())


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    started = time.monotonic()
    if opts.worker:
        worker(opts)
        end_worker()
    print(f"tiny DDP model (2 x Linear {opts.width}), gloo on CPU, {os.cpu_count()} cores; {opts.blocks} blocks of "
          f"{opts.block_steps} steps per mode, modes in turn; block = mean step; added = median of paired per-block "
          "differences")
    print(f"{'ranks':>5} {'step, no vote':>14} {'blocking vote adds':>26} {'pipelined vote adds':>26}")
    for world_size in opts.world_sizes:
        print(row(world_size, measure(opts, world_size)))
    print(f"took {time.monotonic() - started:.0f} s")
    return 0


def row(world_size: int, means: dict[str, list[float]]) -> str:
    """The table's row of one world size from its per-block mean steps by mode (`measure`): the median
    step without a vote, and what each vote adds (median of the paired per-block differences)."""
    base = statistics.median(means["none"])
    cells = []
    for name in ("blocking", "pipelined"):
        added = statistics.median(m - b for m, b in zip(means[name], means["none"], strict=True))
        cells.append(f"{added * 1e6:>10.0f} us {added / base:>8.2%}")
    return f"{world_size:>5} {base * 1e3:>11.3f} ms {cells[0]:>26} {cells[1]:>26}"


if __name__ == "__main__":
    sys.exit(main())
