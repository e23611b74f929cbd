"""torchrevive: a fault-tolerant elastic training runtime for PyTorch.

The front door is one object:

    import elastic
    with elastic.Run.from_args(args) as run: ...      # see elastic/_worker/run/run.py

Underneath, its parts stay usable alone, in layers (docs/architecture.md draws
them; import-linter contracts in pyproject.toml keep them):

- the worker side, top to bottom: `run` (the front door), `checkpoint` (the
  state manager), the worker services (`data`, `metrics`, `parallel`,
  `preemption`, `replicas`, `watchdog`, `progress`, `schedules`, `events`,
  `sampler`, `rng`, `agreement`), `runtime` and `round_store`;
- the agent side, beside the workers in torchrun's agent: `launcher`
  (torchrevive-run, the snapshot keeper, warm starts) and `rendezvous` (etcd-v3);
- below both: `storage` (checkpoint formats and the one commit), `config`
  (`RunConfig`, the flags), `cli`, `errors`, `version`, `recovery_defaults`,
  `slow_imports`, `fault_hook`, `slurm` (Slurm's variables, scontrol, the requeue signal);
- on top, imported by nothing in the library: `chaos` (fault injection, audits),
  `report`, `run_history`.

It never imports a recipe: dependencies point recipes -> elastic -> torch.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

from elastic._shared.common.version import __version__ as __version__
from elastic._shared.slurm.requeue import catch_early

# In a Slurm job, the requeue signal (USR1) reaches every process of a step, and its default action
# ends a process: from here on it is remembered until the run's handler acts on it (elastic._shared.slurm.requeue).
catch_early(os.environ)

__all__ = ["ArgumentParser", "Run", "RunConfig", "add_runtime_arguments", "seeded_samples"]

if TYPE_CHECKING:
    from elastic._worker.config import ArgumentParser, RunConfig, add_runtime_arguments
    from elastic._worker.data.feed import seeded_samples
    from elastic._worker.run.run import Run


_EXPORTS = {
    "ArgumentParser": "elastic._worker.config",
    "Run": "elastic._worker.run.run",
    "RunConfig": "elastic._worker.config",
    "add_runtime_arguments": "elastic._worker.config",
    "seeded_samples": "elastic._worker.data.feed",
}


def __getattr__(name: str) -> Any:
    # Lazy: the launcher and the rendezvous plugin import `elastic.*` modules and
    # must not pay for (or depend on) the training-side imports.
    if name not in _EXPORTS:
        raise AttributeError(f"module 'elastic' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
