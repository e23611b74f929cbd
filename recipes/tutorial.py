"""The classic PyTorch DDP tutorial, made fault-tolerant through `elastic.Run`.

A small network learns a synthetic classification task (built in: nothing to
download) from an ordinary DataLoader with worker processes. Lines marked
`# elastic` are all the runtime takes; without them this is the tutorial's
script. Alone, or under torchrun / torchrevive-run (the same line on each node):

    python recipes/tutorial.py --max-steps 200 --ckpt-dir ckpt
    torchrevive-run --nnodes=1:4 --nproc-per-node=2 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29400 --rdzv-id=tutorial recipes/tutorial.py --ckpt-dir ckpt

Kill any worker at any step: the job restarts it, every rank reloads the newest
checkpoint, and the run ends bit-identical to one never interrupted.

Data: `--data FILE.npz` with arrays `x` (float, N x FEATURES) and `y` (int
labels in 0..CLASSES-1) trains on your own; loaded without pickles.
"""

from __future__ import annotations

import argparse
import sys
import zipfile

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import elastic  # elastic
from elastic import (  # elastic
    non_negative_int,
    positive_float,
    positive_int,
    run_main,
)

FEATURES, CLASSES, SAMPLES = 32, 8, 8192


class Teacher(Dataset):
    """Points labelled by a fixed random linear teacher; each read adds a little noise (an augmentation)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, noise: float = 0.05) -> None:
        self.x, self.y, self.noise = x, y, noise

    @classmethod
    def synthetic(cls) -> Teacher:
        generator = torch.Generator().manual_seed(0)  # the same data set on every rank and every run
        x = torch.randn(SAMPLES, FEATURES, generator=generator)
        teacher = torch.randn(FEATURES, CLASSES, generator=generator)
        return cls(x, (x @ teacher).argmax(dim=1))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index] + self.noise * torch.randn(FEATURES), self.y[index]


def npz_data(path: str) -> Teacher:
    """`--data`: your own points, checked (a bad file is one line and exit 2); never unpickles."""
    try:
        with np.load(path, allow_pickle=False) as arrays:
            x, y = torch.from_numpy(arrays["x"]).float(), torch.from_numpy(arrays["y"]).long()
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as exc:
        raise argparse.ArgumentTypeError(f"{path} is not an .npz file with arrays x and y ({exc})") from None
    if x.ndim != 2 or x.shape[1] != FEATURES or y.shape != (len(x),) or len(x) == 0:
        raise argparse.ArgumentTypeError(f"{path}: x must be N x {FEATURES} and y N labels, not {tuple(x.shape)} and {tuple(y.shape)}")
    if y.min() < 0 or y.max() >= CLASSES:
        raise argparse.ArgumentTypeError(f"{path}: labels must be in 0..{CLASSES - 1}")
    return Teacher(x, y)


class Net(nn.Module):
    def __init__(self, hidden: int = 128, dropout: float = 0.1) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def build_parser() -> argparse.ArgumentParser:
    p = elastic.ArgumentParser(prog="tutorial.py", description="The DDP tutorial, fault-tolerant.")  # elastic
    p.add_argument("--max-steps", type=positive_int, default=300, help="optimizer steps in the whole run")
    p.add_argument("--batch-size", type=positive_int, default=64, help="samples per rank per step")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="learning rate (AdamW)")
    p.add_argument("--data", type=npz_data, default=None, help="an .npz file with arrays x and y (default: the synthetic task)")
    p.add_argument("--workers", type=non_negative_int, default=2, help="DataLoader worker processes per rank")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    dataset = args.data if args.data is not None else Teacher.synthetic()
    with elastic.Run.from_args(args) as run:  # elastic
        model = run.ddp(Net().to(run.device))  # elastic
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        run.start(model=model, optimizer=optimizer, data=dataset, batch_size=args.batch_size)  # elastic
        loader = DataLoader(elastic.seeded_samples(dataset, args.seed), batch_sampler=run.batch_sampler(), num_workers=args.workers)  # elastic
        for x, y in run.batches(loader, max_steps=args.max_steps):  # elastic
            x, y = x.to(run.device), y.to(run.device)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.log(loss)  # elastic
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))  # elastic: a fault of the world is one line and an exit status
