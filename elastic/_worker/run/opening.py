"""How a run opens and how it is left: joining the group, `Run.start`'s registration and restore, leaving.

Invariants (the ordering rules a recipe used to keep by hand):
- `join` joins the process group (or adopts one the script already made) and seeds every generator
  with `seed` on every rank, so the model built next starts identical everywhere.
- `start` then gives each rank its own random stream (`seed + rank`), serves metrics, restores, and
  only then counts the run as started: a scrape sees the restore, a kill during restore loses nothing.
- `leave` closes what the run opened in reverse order (saves in flight commit, SIGTERM's handler is
  put back, metrics and the log close), then leaves the group it made, as failed when it failed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic._shared.common.cli import configure_logging
from elastic._shared.protocol import fault_hook
from elastic._worker.checkpoint.training_state import Stateful
from elastic._worker.control.preemption import PreemptionHandler
from elastic._worker.control.watchdog import watchdog
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.integrity.loop_part import Integrity
from elastic._worker.observe.events import EventLog
from elastic._worker.observe.metrics import start_metrics
from elastic._worker.observe.slow_ranks import SlowRanks
from elastic._worker.run.core import RunCore
from elastic._worker.run.group import RegisteredState
from elastic._worker.run.builtin_parts import IntegrityPart, SlowRanksPart
from elastic._worker.run.survivors_part import SurvivorsHost, SurvivorsPart
from elastic._worker.runtime import parallel
from elastic._worker.runtime.context import adopt_worker, init_worker, leave_group
from elastic._worker.runtime.parallel import unwrap
from elastic._worker.runtime.rng import seed_all
from elastic._worker.runtime.worker_env import WorkerEnv
from elastic._worker.survivors.plugin import Survivors

logger = logging.getLogger(__name__)


def join(core: RunCore) -> None:
    """`Run.__enter__`: join the job (see the module docstring)."""
    cfg = core.config
    env = WorkerEnv.read()  # the worker's environment, read once: every part takes it from ctx.env
    if not logging.getLogger().handlers:  # a script that set up no logging still sees progress
        configure_logging(rank=env.rank_hint)
    timeout = timedelta(seconds=cfg.collective_timeout)
    if dist.is_available() and dist.is_initialized():
        core.ctx = adopt_worker(cfg.device, timeout=timeout, env=env)
    else:
        # Under torchrevive-run --survivors keep|train-on: heals in place (elastic._worker.survivors).
        core.survivors = Survivors.from_environ(env.variables, timeout=timeout, heal_wait=timedelta(seconds=cfg.heal_wait))
        first_group = core.survivors.first_group() if core.survivors is not None else {}
        core.ctx = init_worker(cfg.device, timeout=timeout, env=env, **first_group)
        core.owns_group = core.ctx.distributed
    try:
        seed_all(cfg.seed, core.ctx.device)  # the model built next is identical on every rank
        joiner = core.survivors is not None and core.survivors.joiner  # rank 0 of a group of its own
        core.events = core.stack.enter_context(
            EventLog(cfg.events if core.ctx.is_main and not joiner else None, restart=core.ctx.restart_count,
                     notes_dir=core.ctx.env.notes_dir))
        core.watchdog = watchdog(cfg.hang_timeout, distributed=core.ctx.distributed, env=core.ctx.env)  # armed by step 1
        core.stack.callback(core.watchdog.close)
    except BaseException:
        leave(core, failed=True)
        raise


def leave(core: RunCore, *, failed: bool) -> None:
    """Close what the run opened, then leave the group it made (see the module docstring)."""
    core.leaving_failed = failed
    try:
        core.stack.close()  # commits saves in flight, puts SIGTERM back, closes metrics and the log
    except BaseException:
        failed = True
        raise
    finally:
        if core.owns_group:
            core.owns_group = False
            leave_group(core.context, failed=failed)


def wrap_ddp(core: RunCore, model: torch.nn.Module, options: dict[str, Any]) -> torch.nn.Module:
    """`Run.ddp`: `model` under DistributedDataParallel (as is alone); the survivors' step guard reduces its gradients."""
    survivors = core.survivors
    if survivors is not None:
        survivors.prepare_ddp(options)
    wrapped = parallel.ddp(core.context, model, **options)
    if survivors is not None:
        survivors.attach(wrapped)
    return wrapped


def start(
    core: RunCore,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Any,
    batch_size: int,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    scaler: torch.amp.GradScaler | None,
    extra: Mapping[str, Stateful] | None,
    tokens_per_sample: int,
) -> int:
    """`Run.start`: register the state, restore it, count the run started; the step to continue from."""
    ctx, cfg = core.context, core.config
    if core.started:
        raise RuntimeError("Run.start() was already called")
    core.model = unwrap(model)
    num_samples = data if isinstance(data, int) else len(data)
    core.sampler = sampler = ElasticSampler(num_samples, batch_size=batch_size, seed=cfg.seed)
    core.tokens_per_sample = tokens_per_sample
    core.integrity = integrity = Integrity(ctx, cfg, core.events)  # replica checks, numeric guard (elastic._worker.integrity)
    core.slow_ranks = slow = core.stack.enter_context(SlowRanks(ctx, cfg, core.events, core.model, sampler=sampler, ddp=model))
    builtin = [SlowRanksPart(slow, core.survivors), IntegrityPart(integrity)]  # built-in parts first
    core.parts.members[:0] = builtin + ([SurvivorsPart(core.survivors, core)] if core.survivors is not None else [])
    core.state = RegisteredState(core.model, optimizer, sampler, scheduler, scaler, integrity.registered(extra))
    # Leaving on an error, peers may be dead: a save in flight (its writers meet in
    # collectives) gets a few seconds, not --ckpt-timeout.
    core.stack.callback(lambda: core.checkpoints is not None and core.checkpoints.close(  # a clean end lets go
        wait=5.0 if core.leaving_failed else None, ended=not core.leaving_failed))
    survivors = core.survivors
    # ELASTIC_FAULT, for the chaos suite: a fault names the rank a worker started as.
    core.faults = fault_hook.for_worker(survivors.fault_rank() if survivors else ctx.rank, ctx.restart_count,
                                       ctx.env.variables)
    if survivors is not None:
        survivors.arm(SurvivorsHost(core), ctx, (optimizer, scheduler, scaler), core.faults)
    joined = survivors is not None and survivors.joiner
    if joined:  # train-on: wait until the group admits this worker, then take a member's state
        survivors.join()  # type: ignore[union-attr]
        ctx = core.context
    core.stack.enter_context(  # before restore, so a scrape sees the restore too
        start_metrics(ctx, core.events, port=cfg.metrics_port, host=cfg.metrics_host, samples_per_step=batch_size,
                      tokens_per_sample=tokens_per_sample, watchdog=core.watchdog))
    loop = core.loop
    hook = optimizer.register_step_post_hook(lambda *_: loop.count_optimizer_step())
    core.stack.callback(hook.remove)
    core.preemption = PreemptionHandler(ctx, grace=cfg.term_grace, **ctx.env.preemption)
    core.stack.callback(core.preemption.uninstall)
    if not joined:
        seed_all(cfg.seed + ctx.rank, ctx.device)  # each rank its own stream (dropout); restore overrides it
        core.rebuild_on_group(ctx, None)
        if survivors is not None and survivors.replaces_a_worker:
            core.step = survivors.catch_up_replacement()  # keep: a survivor's state, from its memory
        else:
            core.step = core.group_parts.checkpoints.restore()
        loop.due_after = core.step  # (a joiner's was set when it joined)
    integrity.attach(core.group_parts.checkpoints.state, optimizer, core.faults, core.stack, lambda: loop.loss)
    core.first_step = core.step
    core.started = True
    core.parts.start(core)
    _announce(core, num_samples, batch_size, tokens_per_sample)
    return core.step


def _announce(core: RunCore, num_samples: int, batch_size: int, tokens_per_sample: int) -> None:
    """The "start" event, and rank 0's line."""
    ctx, model = core.context, core.model
    assert model is not None
    parameters = sum(p.numel() for p in model.parameters())
    core.events.emit(
        "start", step=core.step, world_size=ctx.world_size, run_id=ctx.run_id, parameters=parameters,
        device=str(ctx.device), samples_per_step=batch_size * ctx.world_size,
        **({"tokens_per_step": batch_size * tokens_per_sample * ctx.world_size} if tokens_per_sample else {}),
    )
    if ctx.is_main:
        logger.info("training %.2fM parameters on %d samples, world size %d, device %s, from step %d",
                    parameters / 1e6, num_samples, ctx.world_size, ctx.device, core.step)
