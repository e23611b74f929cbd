"""`start_accelerated`: `Run.start` for a script that drives an `accelerate.Accelerator`.

    with elastic.Run.from_args(args) as run:           # first: the run makes the process group
        accelerator = Accelerator(mixed_precision="bf16")
        model, optimizer = accelerator.prepare(model, optimizer)      # DDP, or FSDP2 (fsdp_version=2)
        start_accelerated(run, accelerator, model=model, optimizer=optimizer, scheduler=scheduler,
                          data=train_set, batch_size=B)
        loader = DataLoader(train_set, batch_sampler=run.batch_sampler(), collate_fn=collate)   # not prepared
        for batch in run.batches(loader, max_steps=N):
            loss = model(**{k: v.to(accelerator.device) for k, v in batch.items()}).loss
            accelerator.backward(loss); optimizer.step(); scheduler.step(); optimizer.zero_grad()
            run.log(loss)

What the run saves is what accelerate wraps: the model under its DDP (or the
FSDP2 module itself: its state is saved in shards), the optimizer inside
`AcceleratedOptimizer`, the scheduler inside `AcceleratedScheduler`. The train
loader is not prepared: `accelerator.prepare(loader)` would shard it by its
own sampler, which restarts at the epoch's start; the run's step sampler gives
each rank its share of each step instead. Accelerator settings whose steps are
not the run's steps are refused in one line (`elastic._worker.hf.checks.check_accelerator`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from elastic._worker.checkpoint.training_state import Stateful
from elastic._worker.hf.checks import ACCELERATED, check_accelerator, check_dataset
from elastic._worker.hf.exits import exit_on_elastic_error
from elastic._worker.run.run import Run


def _inner(wrapped: Any, wrapper: str, attribute: str) -> Any:
    """The object an accelerate wrapper holds (`AcceleratedOptimizer.optimizer`), or `wrapped` itself."""
    return getattr(wrapped, attribute) if type(wrapped).__name__ == wrapper else wrapped


def start_accelerated(
    run: Run,
    accelerator: Any,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Any,
    batch_size: int,
    scheduler: Any = None,
    extra: Mapping[str, Stateful] | None = None,
    tokens_per_sample: int = 0,
) -> int:
    """`run.start` with accelerate's prepared objects; returns the step to continue from.

    `batch_size`: samples per rank per step (one optimizer step). A collective, as `run.start`.
    """
    with exit_on_elastic_error():
        check_accelerator(accelerator, scheduler)
        if not isinstance(data, int):
            check_dataset(data, ACCELERATED)
    return run.start(
        model=accelerator.unwrap_model(model),
        optimizer=_inner(optimizer, "AcceleratedOptimizer", "optimizer"),
        scheduler=_inner(scheduler, "AcceleratedScheduler", "scheduler"),
        data=data, batch_size=batch_size, extra=extra, tokens_per_sample=tokens_per_sample,
    )
