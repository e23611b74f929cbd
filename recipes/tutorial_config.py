"""The DDP tutorial as a config-file script (hydra's shape: `main(cfg)` on a config mapping), made
fault-tolerant through `elastic.Run`: tutorial_config_ddp.py is the script before the port.

The config is recipes/tutorial.toml; its `[train]` section, handed to `elastic.Run.from_args` as it is
(a hydra `DictConfig` section, a dict, a dataclass: the same), holds the runtime's settings under their
`elastic.RunConfig` names beside the script's own, which the runtime leaves alone. Override any key on
the command line, as hydra takes them:

    python recipes/tutorial_config.py train.epochs=3 train.ckpt_dir=ckpt
    torchrevive-run --standalone --nproc-per-node=2 recipes/tutorial_config.py train.ckpt_dir=ckpt

Lines marked `# elastic` are the port (tests/unit/test_tutorial_port.py counts them); a bad setting
is one line and exit 2, as for the flags.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tutorial_model import Net, datasets, evaluate, load_config

from elastic import Run, run_main, seeded_samples  # elastic


def main(cfg: Mapping[str, Any]) -> int:
    train = cfg["train"]
    dataset, test_set = datasets(cfg["data"]["path"] or None)
    with Run.from_args(train) as run:  # elastic
        model = run.ddp(Net())  # elastic
        optimizer = torch.optim.AdamW(model.parameters(), lr=train["lr"])
        run.start(model=model, optimizer=optimizer, data=dataset, batch_size=train["batch_size"])  # elastic
        loader = DataLoader(seeded_samples(dataset, train["seed"]), batch_sampler=run.batch_sampler(), num_workers=train["workers"])  # elastic
        for epoch in run.epochs(train["epochs"]):  # elastic
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
    sys.exit(run_main(lambda _: main(load_config(sys.argv[1:]))))  # elastic: a fault of the world is one line
