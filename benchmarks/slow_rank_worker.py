"""One rank of `benchmarks/slow_rank.py`: a small MLP trained data-parallel on CPU (gloo), either as plain
DDP (`--mode ddp`: torch's DistributedDataParallel, each rank its even slice of each global batch) or
under `elastic.Run` (`--mode report|rebalance`: the runtime's `--slow-ranks`, no loader: `run.batches()`).

Rank 0 appends one line per step to `--steps-file`: {"step", "time"} (wall clock, after the step's
update), so the benchmark measures every mode the same way. Started by the benchmark with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; under `elastic.Run`, wrapped by `-m elastic.chaos.samples`
for the exactly-once audit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import elastic

SAMPLES, FEATURES, CLASSES = 4096, 256, 10


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(SAMPLES, FEATURES, generator=generator), torch.randint(0, CLASSES, (SAMPLES,), generator=generator)


def model() -> torch.nn.Module:
    width = 1024
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, CLASSES))


def plain_ddp(args: argparse.Namespace, note) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = torch.nn.parallel.DistributedDataParallel(model())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = data()
    for step in range(1, args.steps + 1):
        start = ((step - 1) * world + rank) * args.batch_size
        rows = torch.arange(start, start + args.batch_size) % SAMPLES
        loss = torch.nn.functional.cross_entropy(net(x[rows]), y[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        note(step, rank)
    dist.barrier()  # neither rank tears gloo down while the other still reduces (an abort at exit otherwise)
    dist.destroy_process_group()


def under_run(args: argparse.Namespace, note) -> None:
    with elastic.Run(device="cpu", slow_ranks=args.mode, events=args.events, snapshot_every=0, ckpt_every=0,
                     hang_timeout=0) as run:
        net = run.ddp(model())
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
        x, y = data()
        run.start(model=net, optimizer=optimizer, data=SAMPLES, batch_size=args.batch_size)
        for rows in run.batches(max_steps=args.steps):
            loss = torch.nn.functional.cross_entropy(net(x[rows]), y[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.log(loss)
            note(run.step + 1, run.rank)


def main() -> None:
    parser = argparse.ArgumentParser(prog="slow_rank_worker.py")
    parser.add_argument("--mode", choices=("ddp", "report", "rebalance"), required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps-file", required=True)
    parser.add_argument("--events", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = open(args.steps_file, "a") if os.environ.get("RANK") == "0" else None

    def note(step: int, rank: int) -> None:
        if out is not None:
            out.write(json.dumps({"step": step, "time": time.time()}) + "\n")
            out.flush()

    try:
        (plain_ddp if args.mode == "ddp" else under_run)(args, note)
    except elastic.Preempted:  # the benchmark's SIGTERM: every rank stopped at one step
        sys.exit(143)


if __name__ == "__main__":
    main()
