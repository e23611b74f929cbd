"""The classic PyTorch DDP tutorial (tutorial_ddp.py beside it), made fault-tolerant through `elastic.Run`.

A small network learns a synthetic classification task (built in: nothing to download) from an
ordinary DataLoader with worker processes, epoch by epoch, and is evaluated on a shuffled test set at
the end of each. Lines marked `# elastic` are all the runtime takes (10; tests/unit/test_tutorial_port.py
counts the lines that differ from tutorial_ddp.py). Alone, or under torchrun / torchrevive-run (the same
line on each node):

    python recipes/tutorial.py --epochs 3 --ckpt-dir ckpt
    torchrevive-run --standalone --nproc-per-node=2 recipes/tutorial.py --ckpt-dir ckpt
    torchrevive-run --nnodes=1:4 --nproc-per-node=2 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29400 --rdzv-id=tutorial recipes/tutorial.py --ckpt-dir ckpt

Kill any worker at any step, its evaluation included: the job restarts it, every rank reloads the
newest checkpoint, and the run ends bit-identical to one never interrupted (each epoch's end runs as
`run.pause()` does: it never moves the training's random streams).

Data: `--data FILE.npz` with arrays `x` (float, N x FEATURES) and `y` (int labels in 0..CLASSES-1)
trains on your own; loaded without pickles.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tutorial_model import Net, datasets, evaluate, npz_data, positive_int

from elastic import ArgumentParser, Run, run_main, seeded_samples  # elastic


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="tutorial.py", description="The DDP tutorial, fault-tolerant.", device="cpu", ckpt_every="1e")  # elastic
    p.add_argument("--epochs", type=positive_int, default=3, help="passes over the training set")
    p.add_argument("--batch-size", type=positive_int, default=64, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (AdamW)")
    p.add_argument("--data", type=npz_data, default=None, help="an .npz file with arrays x and y (default: the synthetic task)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per rank")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    dataset, test_set = datasets(args.data)
    with Run.from_args(args) as run:  # elastic
        model = run.ddp(Net())  # elastic
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        run.start(model=model, optimizer=optimizer, data=dataset, batch_size=args.batch_size)  # elastic
        loader = DataLoader(seeded_samples(dataset, args.seed), batch_sampler=run.batch_sampler(), num_workers=args.workers)  # elastic
        for epoch in run.epochs(args.epochs):  # elastic
            for x, y in run.batches(loader):  # elastic
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                run.log(loss)  # elastic
            accuracy = evaluate(model, test_set)
            print(f"epoch {epoch}: test accuracy {accuracy:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))  # elastic: a fault of the world is one line and an exit status
