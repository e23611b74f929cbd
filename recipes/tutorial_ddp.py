"""The classic PyTorch DDP tutorial as people write it, kept beside its fault-tolerant port (tutorial.py).

Not a recipe of the runtime: the reference the port is measured against (tests/unit/test_tutorial_port.py
counts the lines that differ; the README shows them). Under torchrun only:

    torchrun --standalone --nproc-per-node=2 recipes/tutorial_ddp.py --epochs 3

A killed worker ends this job, and a restart begins again at epoch 0 from the last `ckpt.pt`, if at all.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from tutorial_model import Net, datasets, evaluate, npz_data, positive_int


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tutorial_ddp.py", description="The DDP tutorial.")
    p.add_argument("--seed", type=int, default=0, help="the data order")
    p.add_argument("--epochs", type=positive_int, default=3, help="passes over the training set")
    p.add_argument("--batch-size", type=positive_int, default=64, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (AdamW)")
    p.add_argument("--data", type=npz_data, default=None, help="an .npz file with arrays x and y (default: the synthetic task)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per rank")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    dataset, test_set = datasets(args.data)
    dist.init_process_group("gloo")
    model = DDP(Net())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sampler = DistributedSampler(dataset, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        accuracy = evaluate(model, test_set)
        print(f"epoch {epoch}: test accuracy {accuracy:.3f}", flush=True)
        if dist.get_rank() == 0:
            torch.save(model.module.state_dict(), "ckpt.pt")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
