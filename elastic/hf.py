"""Hugging Face users get the front door's guarantees: `Trainer` and `accelerate` scripts.

    from elastic.hf import Trainer            # instead of transformers.Trainer: the only changed line

    trainer = Trainer(model=model, args=TrainingArguments(..., max_steps=1000), train_dataset=train_set)
    trainer.train()                           # restores the newest good checkpoint by itself
    trainer.save_model()                      # a normal Hugging Face model directory

and, for a script that drives an `accelerate.Accelerator` itself:

    with elastic.Run.from_args(args) as run:
        accelerator = Accelerator()
        model, optimizer = accelerator.prepare(model, optimizer)
        elastic.hf.start_accelerated(run, accelerator, model=model, optimizer=optimizer, scheduler=scheduler,
                                     data=train_set, batch_size=B)
        loader = DataLoader(train_set, batch_sampler=run.batch_sampler(), collate_fn=collate)
        for batch in run.batches(loader, max_steps=N): ...

Both run on `elastic.Run` (elastic/_worker/run/run.py): the data position comes from the
elastic sampler (exact at any world size, no batch skipping), the checkpoint
holds model, optimizer, scheduler, grad scaler and every rank's RNG, saves are
asynchronous, a SIGTERM commits on every rank and exits 143. What the
integration cannot keep exact is refused at start in one line
(elastic/_worker/hf/checks.py). docs/huggingface.md is the user's page.

This package sits on top of the front door: `transformers` and `accelerate`
(the `hf` extra) are imported only here, and only when used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["Trainer", "start_accelerated"]

if TYPE_CHECKING:
    from elastic._worker.hf.accelerated import start_accelerated
    from elastic._worker.hf.trainer import Trainer

_EXPORTS = {"Trainer": "elastic._worker.hf.trainer", "start_accelerated": "elastic._worker.hf.accelerated"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'elastic.hf' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
