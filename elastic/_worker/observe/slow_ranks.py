"""A `Run`'s part that finds slow ranks (`--slow-ranks`) and names them: one line, one event per episode.

    slow = SlowRanks(ctx, config, events, model)   # hooks on the model's gradients measure the work
    # the loop: slow.step_started() ... slow.step_ended(); the vote carries slow.figures()
    slow.verdict(verdict.slots, step)               # every rank, at the same vote step

Invariants:
- Off (`--slow-ranks off`) it measures nothing and the vote carries no figures.
- A rank's figure is its own work per sample (elastic._worker.observe.stragglers.WorkClock): the
  gradient hooks mark its arrival at the all-reduce, so waiting for a slower peer is not work.
- Every rank decides on the same figures (the vote's MAX of one slot per rank), so every rank
  learns of an episode at the same vote step: naming the ranks' places (node and host) is then a
  collective every rank takes, once per group, at the first episode.
- Under `rebalance` (and `evict`) the same figures move the cut of the global batch between ranks
  (elastic._worker.observe.rebalance): every rank sets the same shares at the same vote step, and
  `verdict` says so, so the loop opens a loader again at the new shares. Under `off` and `report`
  the shares stay even and no gradient is touched: the run's math and samples are as without this part.
- An episode is reported once when it starts (`straggler` event: rank, node, host, slowdown, step;
  one warning line on rank 0, at most one a minute per rank: `LineBudget`) and once when it ends
  (`straggler_recovered`); the events feed the per-rank metric `rank_slowdown` on the rank named.
- Under `evict` a rank past `--evict-factor` (or too slow for its smallest share) is evicted
  (elastic._worker.observe.eviction): every rank decides it at the same vote step; a
  `straggler_evicted` event and one line say so, and where it may leave (`can_leave`: --survivors
  train-on, the job above its minimum without its node) the rank raises `EvictedError` (its worker
  exits `EVICTED_EXIT`, its node is set aside) while the others train on; else it is kept, rebalanced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import torch

from elastic._shared.common.errors import UsageError
from elastic._worker.config import RunConfig
from elastic._worker.control import agreement
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.observe.events import EventLog
from elastic._worker.observe.eviction import EvictedError, Eviction, Evictions
from elastic._worker.observe.rebalance import GradientWeights, Rebalancer
from elastic._worker.observe.stragglers import Episode, LineBudget, StragglerWatch, WorkClock
from elastic._worker.runtime.context import WorkerContext
from elastic._worker.runtime.worker_env import WorkerEnv

logger = logging.getLogger(__name__)


def _sharded(parameter: torch.Tensor) -> bool:
    """A parameter FSDP2 shards (a DTensor): its gradient is reduce-scattered, not averaged by DDP."""
    from torch.distributed.tensor import DTensor

    return isinstance(parameter, DTensor)

_TEXT_LIMIT = 200


@dataclass(frozen=True)
class Place(agreement.Message):
    """Where a rank runs, as its peers name it."""

    node: str
    host: str

    def checked(self) -> Place:
        if not (isinstance(self.node, str) and isinstance(self.host, str)):
            raise ValueError(f"a rank's place from a peer is not two names: {self!r}")
        return Place(self.node[:_TEXT_LIMIT], self.host[:_TEXT_LIMIT])


def this_place(env: WorkerEnv) -> Place:
    """Where this rank runs: its agent's node name (else the host's) and its host, as the worker opened."""
    return Place(env.node[:_TEXT_LIMIT], env.host[:_TEXT_LIMIT])


class SlowRanks:
    """Measures this rank's work per sample and reports straggler episodes (see the module docstring)."""

    def __init__(
        self, ctx: WorkerContext, config: RunConfig, events: EventLog, model: torch.nn.Module | None,
        *, sampler: ElasticSampler | None = None, group: Any = agreement.DEFAULT_GROUP,
        clock: Callable[[], float] = perf_counter, ddp: Any = None,
    ) -> None:
        """`sampler`: the run's (its shares: what a step's samples are, what rebalancing moves); `group`: the
        ranks' group for naming places (default: the control group); `clock`: the work's clock; `ddp`: the
        model as the script wraps it (a DDP takes the gradients' weights in its all-reduce)."""
        self.enabled = config.slow_ranks != "off"
        self.sampler = sampler
        self.rebalancing = config.slow_ranks in ("rebalance", "evict")
        self.evictions = Evictions(factor=config.evict_factor) if config.slow_ranks == "evict" else None
        if self.rebalancing and sampler is None:
            raise ValueError("rebalancing moves a sampler's shares: give it the run's sampler")
        if self.rebalancing and model is not None and any(_sharded(p) for p in model.parameters()):
            raise UsageError(f"--slow-ranks {config.slow_ranks} weights each rank's gradient before DDP's mean, which a "
                             "sharded (FSDP) model does not take; use --slow-ranks report")
        self.weights = GradientWeights(model if self.rebalancing else None, ddp)
        self.rebalancer = Rebalancer(sampler, window=config.slow_window) if sampler is not None else None
        self._samples = 0
        self.ctx, self.events, self.group = ctx, events, group
        self.clock = WorkClock(clock)
        self.watch = StragglerWatch(factor=config.slow_factor, window=config.slow_window)
        self.lines = LineBudget()  # rank 0's lines: at most one a minute per rank (every episode is an event)
        self._places: list[Place] | None = None
        self.episodes: list[Episode] = []
        """The episodes the newest vote started or ended."""
        self._hooks: list[Any] = []
        if self.enabled and model is not None:
            self._hooks = [p.register_post_accumulate_grad_hook(self._arrived)
                           for p in model.parameters() if p.requires_grad]

    def _arrived(self, _parameter: torch.Tensor) -> None:
        self.clock.arrived()

    def __enter__(self) -> SlowRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.weights.close()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def on_new_group(self, ctx: WorkerContext, group: Any = agreement.DEFAULT_GROUP) -> None:
        """The group changed in place: other ranks, so new histories and places."""
        self.ctx, self.group = ctx, group
        self.watch.reset()
        if self.evictions is not None:
            self.evictions.reset()
        if self.rebalancer is not None:
            self.rebalancer.reset()
        self._places = None

    def step_started(self) -> None:
        """A step starts: its samples (this rank's share in effect) and the weight of its gradient."""
        if not self.enabled:
            return
        self.clock.started()
        if self.sampler is not None:
            self._samples = self.sampler.share(self.ctx.rank, self.ctx.world_size)[1]
            if self.rebalancing:
                self.weights.scale = self._samples / self.sampler.batch_size
        else:
            self._samples = 1

    def step_ended(self) -> None:
        if self.enabled:
            self.clock.ended(self._samples)

    def figures(self) -> list[int] | None:
        """This rank's ballot: its work per sample since its last vote in its own slot, 0 in the others'."""
        if not self.enabled:
            return None
        slots = [0] * self.ctx.world_size
        slots[self.ctx.rank] = self.clock.take()
        return slots

    def verdict(self, work: tuple[int, ...], step: int, *, can_leave: bool = False) -> bool:
        """A vote's figures (every rank, the same ones at the same step): report the episodes they start or
        end, rebalancing set new shares, and under `evict` evict a rank; True when the shares changed
        (every rank alike). `can_leave` (the same on every rank): an evicted rank may leave the job; the
        evicted rank then raises `EvictedError` here, after the event."""
        if not self.enabled or len(work) != self.ctx.world_size:
            return False
        self.episodes = self.watch.observe(work)
        if self.episodes:
            places = self._gathered_places()
            for episode in self.episodes:
                self._report(episode, places[episode.rank], step)
        if not self.rebalancing or self.rebalancer is None or self.sampler is None:
            return False
        shares = self.rebalancer.observe(work)
        if self.evictions is not None:
            in_effect = [self.sampler.share(rank, self.ctx.world_size)[1] for rank in range(self.ctx.world_size)]
            evicted = self.evictions.observe(self.watch, in_effect, self.rebalancer.per_sample)
            if evicted is not None:
                self._evict(evicted, step, can_leave)
                if can_leave:
                    return False  # the group changes at the next collective: the split starts even again
        if shares is None:
            return False
        self.sampler.set_shares(shares)
        self.events.emit("rebalance", step=step, world_size=self.ctx.world_size, shares=list(shares))
        if self.ctx.is_main:
            logger.info("step %d: the global batch of %d is split %s between the ranks (by their speed)",
                        step, sum(shares), "/".join(map(str, shares)))
        return True

    def _evict(self, evicted: Eviction, step: int, can_leave: bool) -> None:
        place = self._gathered_places()[evicted.rank]
        action = "evicted" if can_leave else "kept"
        why = "" if can_leave else ("it stays, rebalanced: eviction needs torchrevive-run --survivors train-on "
                                   "and a job above its minimum size without this rank's node")
        self.events.emit("straggler_evicted", step=step, world_size=self.ctx.world_size, rank=evicted.rank,
                         node=place.node, host=place.host, slowdown=round(evicted.slowdown, 3), action=action,
                         reason=evicted.reason)
        line = (f"rank {evicted.rank} (node {place.node}, host {place.host}) is {'evicted' if can_leave else 'too slow'} "
                f"at step {step}: {evicted.reason}")
        if self.ctx.is_main:
            logger.warning("%s; %s", line, "its node leaves the job, which trains on without it" if can_leave else why)
        if can_leave and evicted.rank == self.ctx.rank:
            raise EvictedError(f"{line}; its node leaves the job, which trains on without it (--slow-ranks evict)")

    def _gathered_places(self) -> list[Place]:
        if self._places is None:
            gathered = agreement.all_gather(self.ctx, this_place(self.ctx.env), Place, self.group)
            self._places = [place.checked() for place in gathered]
        return self._places

    def _report(self, episode: Episode, place: Place, step: int) -> None:
        fields = {"rank": episode.rank, "node": place.node, "host": place.host, "slowdown": round(episode.slowdown, 3)}
        if episode.started:
            self.events.emit("straggler", step=step, world_size=self.ctx.world_size, **fields)
            held = self.lines.start(episode.rank) if self.ctx.is_main else None
            if held is not None:
                logger.warning("rank %d (node %s, host %s) is a straggler: %.2fx the median of the others' work "
                               "per sample, from step %d%s", episode.rank, place.node, place.host, episode.slowdown, step,
                               f" ({held} shorter episodes of it since its last line: see the event log)" if held else "")
        else:
            self.events.emit("straggler_recovered", step=step, world_size=self.ctx.world_size, **fields)
            if self.ctx.is_main and self.lines.end(episode.rank):
                logger.info("rank %d (node %s, host %s) is no longer a straggler: %.2fx the median, at step %d",
                            episode.rank, place.node, place.host, episode.slowdown, step)


def can_leave(survivors: Any, world_size: int) -> bool:
    """Whether an evicted rank may leave the job: under --survivors train-on, healing in place, with the
    job at least its minimum world size without the rank's node (its agent's workers). The same on every
    rank (job-wide settings; nodes of one job start as many workers each)."""
    if survivors is None or not survivors.train_on or not survivors.can_heal:
        return False
    point = survivors.healing.point
    return world_size - point.local_world_size >= max(point.min_world, 1)
