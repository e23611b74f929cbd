"""torchrevive: a fault-tolerant elastic training runtime for PyTorch.

The front door is one object:

    import elastic
    with elastic.Run.from_args(args) as run: ...      # see elastic/run.py

Underneath, its parts stay usable alone, in layers (each imports only the ones
below it):

- `elastic.run`: the front door (`Run`, `RunConfig`) and `elastic.contract`,
  the recipe flags that configure it.
- `elastic.data` (the sampler in a DataLoader), `elastic.sampler`,
  `elastic.preemption`, `elastic.watchdog`, `elastic.events`, `elastic.metrics`,
  `elastic.progress`, `elastic.replicas`, `elastic.rng`: one concern each.
- `elastic.checkpoint`: the state manager (commit, verify, fall back, inspect).
- `elastic.runtime`: who this worker is, its device and process group.
- `elastic.launcher` (torchrevive-run, warm starts, the reaper) and
  `elastic.rendezvous` (the etcd-v3 plugin) run beside the workers, in the
  agent; `elastic.chaos` is the fault-injection tooling and audits.

It never imports a recipe: dependencies point recipes -> elastic -> torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from elastic.version import __version__ as __version__

__all__ = ["ArgumentParser", "Run", "RunConfig", "add_runtime_arguments", "seeded_samples"]

if TYPE_CHECKING:
    from elastic.config import ArgumentParser, RunConfig, add_runtime_arguments
    from elastic.data import seeded_samples
    from elastic.run import Run


_EXPORTS = {
    "ArgumentParser": "elastic.config",
    "Run": "elastic.run",
    "RunConfig": "elastic.config",
    "add_runtime_arguments": "elastic.config",
    "seeded_samples": "elastic.data",
}


def __getattr__(name: str) -> Any:
    # Lazy: the launcher and the rendezvous plugin import `elastic.*` modules and
    # must not pay for (or depend on) the training-side imports.
    if name not in _EXPORTS:
        raise AttributeError(f"module 'elastic' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
