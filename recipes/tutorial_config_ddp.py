"""The DDP tutorial as a config-file script (hydra's shape: `main(cfg)` on a config mapping), kept beside its
fault-tolerant port (tutorial_config.py).

Not a recipe of the runtime: the reference the port is measured against (tests/unit/test_tutorial_port.py).
The config is recipes/tutorial.toml, with hydra-style overrides; under torchrun only:

    torchrun --standalone --nproc-per-node=2 recipes/tutorial_config_ddp.py train.epochs=3
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from tutorial_model import Net, datasets, evaluate, load_config


def main(cfg: Mapping[str, Any]) -> int:
    train = cfg["train"]
    dataset, test_set = datasets(cfg["data"]["path"] or None)
    dist.init_process_group("gloo")
    model = DDP(Net())
    optimizer = torch.optim.AdamW(model.parameters(), lr=train["lr"])
    sampler = DistributedSampler(dataset, seed=train["seed"])
    loader = DataLoader(dataset, batch_size=train["batch_size"], sampler=sampler, num_workers=train["workers"])
    for epoch in range(train["epochs"]):
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
    sys.exit(main(load_config(sys.argv[1:])))
