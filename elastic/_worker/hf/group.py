"""The job's process group, made by the runtime before accelerate makes one of its own.

`transformers.TrainingArguments` builds accelerate's `PartialState` as it is
constructed, and that calls `init_process_group` over env:// when no group
exists. Under stock torchrun every round's workers share the agent's store,
and env:// reads it with no per-round prefix: after a restart a worker can
read a dead round's gloo addresses and hang (elastic/_worker/runtime/round_store.py says how).
So a script that imports `elastic.hf.Trainer` joins the group here first,
through `elastic._worker.runtime.context.init_worker` (a fresh namespace of the store each
round, the collective timeout of `RunConfig`); accelerate then adopts it,
as does the `Run` of `Trainer.train`.

The device is picked as `--device auto` does (a GPU per local worker when
there are GPUs), before the script's `use_cpu` can be read. The group is
left for the process's end: the script's `evaluate()` and `save_model()`
after `train()` still use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from elastic._worker.config import RunConfig
from elastic._worker.runtime.context import init_worker
from elastic._worker.runtime.worker_env import WorkerEnv

LAUNCHED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What a launcher (torchrun, torchrevive-run) puts in a worker's environment."""


def join_before_accelerate(environ: Mapping[str, str] | None = None) -> bool:
    """In a launched worker with no process group yet, join the job's; returns whether it did.
    `environ`: a test's, else the process's (`WorkerEnv.read`)."""
    env = WorkerEnv.read(environ)
    if not all(name in env.variables for name in LAUNCHED) or not dist.is_available() or dist.is_initialized():
        return False
    init_worker("auto", timeout=timedelta(seconds=RunConfig().collective_timeout), env=env)
    return dist.is_initialized()
