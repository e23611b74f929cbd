"""The training script of tests/chaos/test_slow_ranks_job.py: a small MLP under `elastic.Run`, fed by
`run.batches()` (no loader), whose node may be slow on purpose.

    SLOW_SHARE_MS_PER_SAMPLE=2 python tests/slow_share_job.py --max-steps 400 --slow-ranks rebalance ...

Each step sleeps the node's milliseconds per sample of its share before its forward pass: work the
runtime clocks (step start to the gradient all-reduce), so a node at 2 ms runs at half the speed of
one at 1 ms and `--slow-ranks rebalance` gives it about half the samples. The sleep dominates the
step, so the measured speeds, and the shares they make, hold still between votes. Every flag but
--max-steps and --batch-size is the runtime's.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import elastic

SAMPLES, FEATURES = 4096, 8
MS_PER_SAMPLE_ENV = "SLOW_SHARE_MS_PER_SAMPLE"


def main(argv: list[str] | None = None) -> None:
    parser = elastic.ArgumentParser(prog="slow_share_job.py")
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)
    per_sample = float(os.environ.get(MS_PER_SAMPLE_ENV, "0")) / 1000
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(SAMPLES, FEATURES, generator=generator), torch.randn(SAMPLES, 1, generator=generator)
    with elastic.Run.from_args(args) as run:
        net = run.ddp(torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
        run.start(model=net, optimizer=optimizer, data=SAMPLES, batch_size=args.batch_size)
        for rows in run.batches(max_steps=args.max_steps):
            time.sleep(per_sample * len(rows))
            loss = torch.nn.functional.mse_loss(net(x[rows]), y[rows])  # a mean: the weighted gradient holds
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.log(loss)


if __name__ == "__main__":
    sys.exit(elastic.run_main(main))  # a library error (an eviction: 82) is one line and its exit status
