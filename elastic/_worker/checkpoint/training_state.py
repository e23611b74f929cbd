"""What a checkpoint holds of a run: the objects, and how their non-tensor state is taken and given back.

The tensors of the model and optimizer go through `state.Layout` (by stable
key, sharded or owned); everything else of a checkpoint is its trainer state
(`trainer.pt`, and a snapshot part's header): the step, the sampler's position,
the scheduler, the grad scaler, the user's extra objects, modules' extra state,
tied weights, the optimizer's settings and every rank's RNG states.

Invariants:
- The trainer state holds tensors and plain values only, so it loads with
  `weights_only=True`; what could not be read back that way is a `UsageError`
  when it is taken (`plain_state`), not a failed restore later.
- `extra` objects (anything with `state_dict`/`load_state_dict`) hold the same
  state on every rank; rank 0's is saved.
- Applying a trainer state changes the live objects only after the caller has
  read and verified everything; the user's extra objects are given their state
  first, since their own code may refuse it (`CheckpointMismatchError`), and
  then nothing else has changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from elastic._shared.common.errors import CheckpointMismatchError, UsageError
from elastic._worker.checkpoint import state as live_state
from elastic._worker.control import agreement
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.runtime.context import WorkerContext
from elastic._worker.runtime.rng import get_rng_state, seed_all, set_rng_state

# Ranks a grown job has no saved RNG state for are seeded from (seed, step, rank).
_RESEED_STRIDE = 1_000_003
_PLAIN_LEAVES = (torch.Tensor, int, float, bool, str, bytes, type(None))
RUNTIME_EXTRA_PREFIX = "torchrevive."
"""Extra objects the runtime registers itself (the numeric guard's skipped steps): optional in a checkpoint,
so a run resumes one saved with or without them (fit.runtime_owned)."""


class Stateful(Protocol):
    """What an extra object needs to be checkpointed (torch.distributed.checkpoint's protocol)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def plain_state(name: str, tree: Any, path: str = "") -> Any:
    """`tree` if a `weights_only` load can read it back (tensors and plain values in dicts,
    lists and tuples); else a `UsageError` at save time, not a failed restore later."""
    if isinstance(tree, _PLAIN_LEAVES) and (isinstance(tree, torch.Tensor) or type(tree) in _PLAIN_LEAVES):
        return tree
    if type(tree) is dict:
        for key, value in tree.items():
            plain_state(name, value, f"{path}[{key!r}]")
        return tree
    if type(tree) in (list, tuple):
        for i, value in enumerate(tree):
            plain_state(name, value, f"{path}[{i}]")
        return tree
    raise UsageError(
        f"{_state_label(name)}: state_dict(){path} is a {type(tree).__module__}.{type(tree).__qualname__}; "
        "checkpoints hold tensors and plain values only (int, float, str, lists, dicts: convert it)"
    )


def _state_label(name: str) -> str:
    return f"the {name}" if name in ("scheduler", "scaler", "optimizer") else f"extra state {name!r}"


@dataclass(frozen=True)
class RngStates(agreement.Message):
    """One rank's RNG states, as `rng.get_rng_state` gives them, on their way to rank 0."""

    state: dict[str, Any]


class TrainingState:
    """The objects of a run that a checkpoint covers (see the module docstring)."""

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: ElasticSampler,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        scaler: torch.amp.GradScaler | None = None,
        extra: Mapping[str, Stateful] | None = None,
        seed: int = 0,
    ) -> None:
        live_state.check_supported(model, optimizer)
        self.model = model
        self.optimizer = optimizer
        self.sampler = sampler
        self.scheduler = scheduler
        self.scaler = scaler
        self.extra = dict(extra or {})
        for name, obj in self.extra.items():
            if not callable(getattr(obj, "state_dict", None)) or not callable(getattr(obj, "load_state_dict", None)):
                raise TypeError(f"extra state {name!r} ({type(obj).__name__}) has no state_dict/load_state_dict")
        self.seed = seed
        self.layout = live_state.Layout(model, optimizer)

    # -- taking it ------------------------------------------------------------------

    def extra_state(self, *, check: bool = True) -> dict[str, Any]:
        """The extra objects' state dicts (checked to load back with weights_only when `check`)."""
        return {name: plain_state(name, obj.state_dict()) if check else obj.state_dict() for name, obj in self.extra.items()}

    def optimizer_settings(self, *, check: bool = True) -> dict[str, Any]:
        settings = self.layout.settings()
        return plain_state("optimizer", settings) if check else settings

    def trainer_state(
        self, step: int, world_size: int, rng_states: list[dict[str, Any]], extra: dict[str, Any],
        settings: dict[str, Any], *, check: bool = True,
    ) -> dict[str, Any]:
        """The trainer state as of now (its parts referencing live objects; copy it before the next step)."""

        def plain(name: str, tree: Any) -> Any:
            return plain_state(name, tree) if check else tree

        return {
            "step": step,
            "world_size": world_size,
            "sampler": self.sampler.state_dict(),
            "aliases": dict(self.layout.aliases),
            "module_extra": plain("module extra state", self.layout.extra_state()),
            # Checked like extra state: what a weights_only load could not read back fails now, not at restore.
            "scheduler": plain("scheduler", self.scheduler.state_dict()) if self.scheduler is not None else None,
            "scaler": plain("scaler", self.scaler.state_dict()) if self.scaler is not None else None,
            "extra": extra,
            "optimizer": settings,
            "rng": rng_states,
        }

    @staticmethod
    def gather_rng(ctx: WorkerContext) -> list[dict[str, Any]]:
        """Every rank's RNG states, by rank, on rank 0 (a collective; empty elsewhere)."""
        gathered = agreement.gather_to_main(ctx, RngStates(get_rng_state(ctx.device)), RngStates)
        return [g.state for g in gathered] if gathered is not None else []

    # -- giving it back -------------------------------------------------------------

    def apply_extra(self, step: int, trainer: dict[str, Any]) -> None:
        """First of all: the user's code may refuse the state, and then nothing else has changed."""
        for name, obj in self.extra.items():
            if name.startswith(RUNTIME_EXTRA_PREFIX) and name not in trainer.get("extra", {}):
                continue  # saved without it: the object keeps its own (fresh) state
            try:
                obj.load_state_dict(trainer.get("extra", {})[name])
            except Exception as exc:  # noqa: BLE001 - whatever it raises is one line naming the object
                raise CheckpointMismatchError(
                    f"checkpoint step_{step:08d}: extra state {name!r} does not load ({type(exc).__name__}: {exc})"
                ) from None

    def apply_trainer(self, ctx: WorkerContext, step: int, trainer: dict[str, Any]) -> None:
        """Scheduler, scaler, sampler and this rank's RNG (a rank the saved job did not have is seeded)."""
        if self.scheduler is not None and trainer["scheduler"] is not None:
            self.scheduler.load_state_dict(trainer["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(trainer["scaler"])
        self.sampler.load_state_dict(trainer["sampler"])
        rng_states = trainer["rng"]
        if ctx.rank < len(rng_states):
            set_rng_state(rng_states[ctx.rank], ctx.device)
        else:
            seed_all(self.seed * _RESEED_STRIDE + step * 7919 + ctx.rank, ctx.device)
