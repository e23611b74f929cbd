"""torchrevive: a fault-tolerant elastic training runtime for PyTorch.

The front door is one object:

    import elastic
    with elastic.Run.from_args(args) as run: ...

(or, in a script written at module level, `run = elastic.Run.from_args(args).open()`
... `run.close()`: see `Run.open`). Every name a training script needs is here,
and `elastic.hf` holds the Hugging Face ones; `__all__` lists them. Everything
else is internal (`elastic._worker`, `elastic._agent`, `elastic._shared`) and may
move without notice. The tools run as programs: `torchrevive-run`,
`python -m elastic.checkpoint`, `python -m elastic.report`, `python -m elastic.chaos`.

The tree is the architecture (docs/architecture.md draws it; the import-linter
contracts in pyproject.toml keep it): the worker side (`_worker`) and the agent
side (`_agent`) never import each other, what both share (`_shared`) sits below
both, and the tools sit on top, imported by nothing in the library. It never
imports a recipe: dependencies point recipes -> elastic -> torch.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

from elastic._shared.common.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointStorageError,
    CorruptCheckpoint,
    ElasticError,
    PeerLost,
    Preempted,
    UsageError,
)
from elastic._shared.common.version import __version__ as __version__
from elastic._shared.slurm.requeue import catch_early

# In a Slurm job, the requeue signal (USR1) reaches every process of a step, and its default action
# ends a process: from here on it is remembered until the run's handler acts on it (elastic._shared.slurm.requeue).
catch_early(os.environ)

if TYPE_CHECKING:
    from elastic._shared.common.cli import (
        OneLineArgumentParser,
        configure_logging,
        non_negative_float,
        non_negative_int,
        positive_float,
        positive_int,
        run_main,
        unit_interval,
    )
    from elastic._shared.common.slow_imports import prefetch_slow_imports
    from elastic._worker.checkpoint.compat import check_model as check_model_state
    from elastic._worker.checkpoint.reader import load_newest_model_state, read_checkpoint
    from elastic._worker.config import ArgumentParser, RunConfig, add_runtime_arguments
    from elastic._worker.data.feed import seeded_samples
    from elastic._worker.data.sampler import ElasticSampler
    from elastic._worker.run.parts import Change, LoopPart, LoopPartBase
    from elastic._worker.run.run import Run
    from elastic._worker.run.schedules import OneCycle, WarmupCosine
    from elastic._worker.runtime.collectives import all_reduce_mean

# Lazy: the launcher, the rendezvous plugin and the tools import `elastic` first and must not pay for
# (or depend on) the training side's imports. name -> (module, attribute there)
_EXPORTS = {
    # the run
    "Run": ("elastic._worker.run.run", "Run"),
    "RunConfig": ("elastic._worker.config", "RunConfig"),
    "ArgumentParser": ("elastic._worker.config", "ArgumentParser"),
    "add_runtime_arguments": ("elastic._worker.config", "add_runtime_arguments"),
    "LoopPart": ("elastic._worker.run.parts", "LoopPart"),
    "LoopPartBase": ("elastic._worker.run.parts", "LoopPartBase"),
    "Change": ("elastic._worker.run.parts", "Change"),
    # data and the step's math
    "ElasticSampler": ("elastic._worker.data.sampler", "ElasticSampler"),
    "seeded_samples": ("elastic._worker.data.feed", "seeded_samples"),
    "all_reduce_mean": ("elastic._worker.runtime.collectives", "all_reduce_mean"),
    "OneCycle": ("elastic._worker.run.schedules", "OneCycle"),
    "WarmupCosine": ("elastic._worker.run.schedules", "WarmupCosine"),
    # checkpoints without a job
    "load_newest_model_state": ("elastic._worker.checkpoint.reader", "load_newest_model_state"),
    "read_checkpoint": ("elastic._worker.checkpoint.reader", "read_checkpoint"),
    "check_model_state": ("elastic._worker.checkpoint.compat", "check_model"),
    # a script's command line: one-line errors, number parsers, logging, exit statuses
    "OneLineArgumentParser": ("elastic._shared.common.cli", "OneLineArgumentParser"),
    "configure_logging": ("elastic._shared.common.cli", "configure_logging"),
    "run_main": ("elastic._shared.common.cli", "run_main"),
    "positive_int": ("elastic._shared.common.cli", "positive_int"),
    "positive_float": ("elastic._shared.common.cli", "positive_float"),
    "non_negative_int": ("elastic._shared.common.cli", "non_negative_int"),
    "non_negative_float": ("elastic._shared.common.cli", "non_negative_float"),
    "unit_interval": ("elastic._shared.common.cli", "unit_interval"),
    "prefetch_slow_imports": ("elastic._shared.common.slow_imports", "prefetch_slow_imports"),
}

__all__ = [
    *_EXPORTS,
    "CheckpointError", "CheckpointMismatchError", "CheckpointStorageError", "CorruptCheckpoint", "ElasticError",
    "PeerLost", "Preempted", "UsageError", "__version__",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'elastic' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
