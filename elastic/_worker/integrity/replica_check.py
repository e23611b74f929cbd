"""Replica checks during training: every `every` steps the ranks compare parameter digests; a
mismatch is undone by rolling every rank back to the last passing check and replaying, then named.

    check = ReplicaCheck(ctx, rollback_point, model, "auto", events=events, sampler=sampler, skip=skip_step)
    check.start(step)                  # the loop's first step: the first rollback point
    for each step's end:
        back_to = check.after_step(step, save_due=...)   # None, or the step every rank was rolled back to

What a check step does, on every rank (a collective on the control group):

1. the digest of this rank's parameters (elastic._worker.observe.replicas.parameter_digest,
   the digest `Run.finish` compares at the end) and its proposed interval
   (elastic._worker.integrity.check_interval) exchanged: one all-reduce of a few
   bytes says whether every digest agrees, and only a mismatch gathers every
   rank's (elastic._worker.integrity.digest_exchange);
2. all equal: the check passes, and the rollback point moves to this step
   (elastic._worker.integrity.rollback); a check that was a replay's names
   what the mismatch was (`transient`: a `corruption` event, training goes on);
3. a mismatch (elastic._worker.integrity.verdicts.compare names the odd rank
   with three ranks or more): every rank rolls back to the point and the loop
   replays the steps since, checking after every replayed step (a passing one
   moves the point: it is a state every rank computed alike), up to this step;
4. the replay agrees up to this step: `transient` (a `corruption` event);
5. a replayed step differs again: the rank(s) computed that step wrong twice
   from the same state and batch. Every rank rolls back to the step before it
   and trains it a third time with the per-rank blocks of its global batch
   rotated (rank r trains the block of rank r + 1 with rank r + 1's random
   numbers: the loop seeds each step as the rank whose block it trains,
   elastic._worker.runtime.rng.seed_step, so a healthy rank computes exactly what
   that rank did: the sampler's `rotation`, when the loader follows the sampler:
   `rotatable`), and
   verdicts.retried reads the result:
   - the divergence moved with the blocks: the `batch` is at fault. The
     `corruption` event names it (the step, its place in the epoch stream, the
     suspect block's sample indices), every rank rolls back once more and
     trains the step with its update skipped (`skip`: the numeric guard's
     record, so the sample audit and every later checkpoint say so and a
     resumed run skips it again), and training goes on;
   - it stayed with the rank: the rank(s) sit on a faulty `node`
     (`corruption`, kind `node`): each raises `FaultyNodeError` (exit
     `FAULTY_NODE_EXIT`, one line naming its node), which its agent counts
     against that node (set aside after --set-aside-failures strikes, issue 42's
     failure policy); the other ranks wait in a collective that the faulty
     rank's exit breaks, as a peer's failure breaks any collective. When nothing
     names a rank (two ranks that each repeat their own digest), every rank stops
     with one line.

A check also runs at every step a periodic checkpoint is due (`after_step`'s
`save_due`), before the save: a checkpoint is only ever written of a state a
check passed, so a fault between two checks never leaves a poisoned newest
checkpoint behind.

Invariants:
- Every rank checks at the same steps and reads the same gathered digests, so
  every rank takes the same branch at the same step: the interval changes
  only through the gathered proposals (the largest is taken).
- A rollback point always exists from the loop's first step on, and holds the
  newest state a check found equal on every rank (or the loop's first step's:
  restored from a verified checkpoint or seeded alike).
- Under FSDP2 the shards differ by design: the digest covers what is
  replicated (buffers aside, see parameter_digest); each rank's own shards are
  digested as its rollback point is taken and again when it is restored
  (rollback.RollbackPoint's `verify`), and a one-line notice says so.
- The blocks are rotated only for the one step of a retry; every path out of
  a retry resets the rotation before the state is rolled back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from elastic._shared.common.errors import ElasticError
from elastic._shared.protocol.exit_status import FAULTY_NODE_EXIT
from elastic._worker.control import agreement
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.integrity import verdicts
from elastic._worker.integrity.check_interval import CheckInterval
from elastic._worker.integrity.digest_exchange import Gathered, exchange
from elastic._worker.integrity.rollback import RollbackPoint
from elastic._worker.observe.events import EventLog
from elastic._worker.observe.replicas import parameter_digest
from elastic._worker.runtime.context import WorkerContext

logger = logging.getLogger(__name__)

class FaultyNodeError(ElasticError):
    """This rank diverged from its replicas twice at the same step: its node is faulty."""

    exit_code = FAULTY_NODE_EXIT


class ReplicaDivergence(ElasticError):
    """The replicas differ again after a replay, and nothing names the rank at fault."""


REPLAY, RETRY = "replay", "retry"


@dataclass
class _Pending:
    """A mismatch being replayed (`REPLAY`), or the step its replay diverged at being tried again (`RETRY`)."""

    step: int
    digests: list[str]
    back_to: int
    detected: float
    """perf_counter() at detection."""
    wall: float
    """Unix time of detection."""
    phase: str = REPLAY
    at: int | None = None
    """`RETRY`: the step the replay first diverged at."""
    replay: list[str] | None = None
    """`RETRY`: the replay's digests at that step."""
    shift: int = 0
    """`RETRY`: how far the blocks were rotated (0: the loader cannot move them)."""
    replayed_before: int = 0
    """`ReplicaCheck.replayed` at detection (the steps this mismatch trained again are the difference)."""


class ReplicaCheck:
    """One rank's replica checks (see the module docstring)."""

    def __init__(
        self, ctx: WorkerContext, rollback: RollbackPoint, model: torch.nn.Module, setting: int | str, *,
        events: EventLog, group: Any = agreement.DEFAULT_GROUP, node: str | None = None,
        sampler: ElasticSampler | None = None, skip: Callable[[int], bool] | None = None, saves_every: int = 0,
    ) -> None:
        self._ctx = ctx
        self._rollback = rollback
        self._model = model
        self._events = events
        self._group = group
        # The node as the job's agents name it (their failures, hangs, nodes set aside: `WorkerEnv.node`).
        self._node = node if node is not None else ctx.env.node[:200]
        self._setting = setting
        self._sampler = sampler
        self._skip = skip  # skips a step's update (True), or says it was skipped already (False): the guard's record
        self.rotatable = sampler is not None
        """Whether the loader follows the sampler's blocks (the loop says so: elastic._worker.data.feed.Feed)."""
        self._saves_every = saves_every  # steps between periodic checkpoints (0: none): a check runs at each
        self.before_exchange: Callable[[], None] = lambda: None  # a fault point (fault_hook's during_replica_check)
        self.interval = CheckInterval(setting, also_every=saves_every)
        self.enabled = self.interval.every > 0 and ctx.distributed
        self._next: int | None = None
        self._pending: _Pending | None = None
        self._paused = False
        self.checks = 0
        self.seconds = 0.0
        """What the checks (digests, exchanges, rollback points) cost this rank's loop."""
        self.replayed = 0
        """Steps trained again after rollbacks."""
        self.corruptions: list[dict[str, Any]] = []
        """The `corruption` events' fields, in order (every rank's copy)."""
        sharded = any(hasattr(p, "to_local") for p in model.parameters())
        if self.enabled and sharded and ctx.is_main:
            logger.info("replica checks under FSDP2 compare what every rank holds alike: the sharded parameters "
                        "have no replica to compare with (a bit computed wrong in a shard is not caught); each "
                        "rank's shards are digested as its rollback point is taken and checked when it is restored")

    def on_new_group(self, ctx: WorkerContext) -> None:
        """The group changed in place: the checks run on it (the caller takes a new rollback point),
        at the interval a member that just started has: a replacement's is the first one, and every
        member must check at the same steps."""
        self._ctx = ctx
        self.interval = CheckInterval(self._setting, also_every=self._saves_every)
        self.enabled = self.interval.every > 0 and ctx.distributed

    @property
    def every(self) -> int:
        return self.interval.every

    def start(self, step: int, *, group_from: int | None = None) -> None:
        """The loop starts at `step` (a restore's, or the first): the first rollback point, the next check,
        `every` steps after `group_from` (default `step`): where the group went on from, the same on
        every member (a survivor starts after its first step on a group formed in place, a
        replacement before it)."""
        if not self.enabled:
            return
        if self._sampler is not None:
            self._sampler.rotation = 0  # a retry cut short (a rollback of the numeric guard's, a new group)
        if self._rollback.step != step:
            started = time.perf_counter()
            self._rollback.take(step)
            copied = time.perf_counter() - started
            self.seconds += copied
            if self.interval.cost_s() is None:
                self.interval.estimate(2 * copied)  # a copy, and a digest that reads every byte again
        self._next = (step if group_from is None else group_from) + self.interval.every
        self._pending = None
        self._paused = True

    def after_step(self, step: int, settle: Callable[[], None] = lambda: None, *, save_due: bool = False) -> int | None:
        """Step `step` completed on every rank: check when due, or when a checkpoint is due at this step
        (`save_due`, the same on every rank). Returns None, or the step every rank was rolled back to
        (the loop goes on from there). `settle()`, a collective, runs on every rank before a faulty rank
        leaves (the saves in flight commit: they hold states checks passed)."""
        if not self.enabled:
            return None
        self.interval.note_step_end(paused=self._paused)
        self._paused = False
        if self._next is None or (step < self._next and not save_due):
            return None
        started = time.perf_counter()
        try:
            return self._check(step, started, settle)
        finally:
            self._paused = True  # the time until the next step's end holds this check
            cost = time.perf_counter() - started
            self.seconds += cost
            if self._pending is None:
                self.interval.note_cost(cost)

    def _check(self, step: int, started: float, settle: Callable[[], None]) -> int | None:
        self.checks += 1
        mine = parameter_digest(self._model)
        gathered = self._exchange(mine, self.interval.proposal())
        if self.interval.agree(max(gathered.proposals)) and self._ctx.is_main and self.interval.auto:
            logger.info("%s", self.interval.describe())
        found = verdicts.compare(gathered.digests)
        pending = self._pending
        if pending is not None and pending.phase == RETRY:
            return self._retried(pending, step, gathered.digests, settle)
        if found.agreed:
            self._rollback.take(step)
            if pending is not None and step < pending.step:  # a replayed step every rank computed alike
                self._next = step + 1
                return None
            if pending is not None:
                self._resolved(pending, gathered.digests, step)
            self._next = step + self.interval.every
            return None
        if pending is None:
            return self._roll_back(step, gathered.digests, found, started)
        return self._retry(pending, step, gathered.digests)

    def _retry(self, pending: _Pending, step: int, digests: list[str]) -> int:
        """The replay diverged again, first at `step`: train it once more from the step before it
        (the point: every replayed step before it passed), its blocks rotated when the loader allows."""
        pending.phase, pending.at, pending.replay = RETRY, step, digests
        pending.shift = 1 if self.rotatable and self._sampler is not None else 0
        if self._sampler is not None:
            self._sampler.rotation = pending.shift
        back_to = self._rollback.restore()  # (the loop seeds the retried step as the rank whose block each trains)
        self.replayed += step - back_to - (pending.step - step)  # the replay never reached the steps after this one
        self._next = step
        if self._ctx.is_main:
            logger.warning("replica check at step %d: the replay differs again; training step %d once more%s",
                           step, step, " with the ranks' blocks of its batch rotated" if pending.shift else "")
        return back_to

    def _retried(self, pending: _Pending, step: int, digests: list[str], settle: Callable[[], None]) -> int:
        """The third try of step `step`: name the batch (and skip it: returns the step rolled back to) or
        the node (raises)."""
        assert pending.replay is not None
        self._pending = None
        if self._sampler is not None:
            self._sampler.rotation = 0
        classified = verdicts.retried(pending.replay, digests, pending.shift)
        nodes = self._nodes()
        if classified.kind == verdicts.BATCH and self._skip is not None:
            back_to = self._rollback.restore()  # the sampler back before the step: the batch's place in the stream
            batch = self._batch(step, classified.blocks)
            if self._skip(step):
                self.replayed += 1  # the step once more, without its update
                self._corruption(pending, step, verdicts.BATCH, classified.ranks, nodes,
                                 f"step {step}'s batch skipped", batch=batch)
                self._next = step  # the step trained without its update is checked at once
                return back_to
            classified = verdicts.Classified(verdicts.NODE, classified.ranks)  # skipped and still diverging
        action = "node set aside" if classified.ranks else "stopped"
        self._corruption(pending, step, verdicts.NODE, classified.ranks, nodes, action)
        settle()
        if self._ctx.rank in classified.ranks:
            raise FaultyNodeError(
                f"rank {self._ctx.rank} on {self._node} diverged from its replicas at step {step} again after "
                f"rolling back to step {pending.back_to}: its node computes wrong and leaves the job"
            )
        if classified.ranks:  # a faulty rank leaves: this collective fails when it does, as any peer's failure
            agreement.all_ok(self._ctx, True, self._group)
            raise ReplicaDivergence(
                f"rank(s) {', '.join(map(str, classified.ranks))} on {', '.join(nodes[r] for r in classified.ranks)} "
                f"diverged again at step {step} after rolling back to step {pending.back_to} and leave the job"
            )
        raise ReplicaDivergence(
            f"the replicas differ at step {step} again after rolling back to step {pending.back_to}, and each rank "
            "repeated its own result: nothing tells the faulty one (two ranks); stopping"
        )

    def _batch(self, step: int, blocks: tuple[int, ...]) -> dict[str, Any]:
        """Where step `step`'s batch sits (the sampler stands before it): its epoch and place in the
        epoch stream, its size, and the sample indices of the suspect block(s)."""
        sampler, world = self._sampler, self._ctx.world_size
        assert sampler is not None
        indices = sampler.global_batch(world)
        suspect: list[int] = []
        for block in blocks:
            first, count = sampler.share(block, world)
            suspect += indices[first:first + count].tolist()
        return {"step": step, "epoch": sampler.state.epoch, "consumed": sampler.state.consumed,
                "count": len(indices), "blocks": list(blocks), "indices": suspect}

    def _roll_back(self, step: int, digests: list[str], found: verdicts.Comparison, started: float) -> int:
        point = self._rollback.step
        assert point is not None, "start() took the first rollback point"
        self._pending = _Pending(step, digests, point, started, time.time(), replayed_before=self.replayed)
        named = f"rank(s) {', '.join(map(str, found.odd))} differ from the majority" if found.odd else (
            "the ranks differ and no majority names one")
        if self._ctx.is_main:
            logger.warning("replica check at step %d: %s; rolling every rank back to step %d and replaying %d step(s)",
                           step, named, point, step - point)
        back_to = self._rollback.restore()
        self.replayed += step - back_to
        self._next = back_to + 1  # the replay is checked at every step, up to this one
        return back_to

    def _resolved(self, pending: _Pending, replay: list[str], step: int) -> None:
        classified = verdicts.classify(pending.digests, replay)
        self._pending = None
        self._corruption(pending, step, classified.kind, classified.ranks, self._nodes(),
                         f"rolled back to step {pending.back_to} and replayed {step - pending.back_to} step(s)")

    def _corruption(self, pending: _Pending, step: int, kind: str, ranks: tuple[int, ...], nodes: list[str],
                    action: str, batch: dict[str, Any] | None = None) -> None:
        """One `corruption` event per mismatch: `rank` and `node` the first named (None: none could be),
        `ranks` and `nodes` all of them; `batch`: the batch at fault (kind `batch`)."""
        fields = {
            "rank": ranks[0] if ranks else None, "node": nodes[ranks[0]] if ranks else None,
            "ranks": list(ranks), "nodes": [nodes[r] for r in ranks], "kind": kind, "action": action,
            "detected_step": pending.step, "detected_time": pending.wall, "rolled_back_to": pending.back_to,
            "steps_replayed": self.replayed - pending.replayed_before, "replay_seconds": time.perf_counter() - pending.detected,
            **({"retried_step": pending.at} if pending.at is not None else {}),
            **({"batch": batch} if batch is not None else {}),
        }
        self.corruptions.append({"step": pending.step, **fields})
        self._events.emit("corruption", step=pending.step, world_size=self._ctx.world_size, **fields)
        if self._ctx.is_main:
            named = ", ".join(f"rank {r} on {nodes[r]}" for r in ranks) or "no rank named"
            logger.warning("corruption found at step %d: %s (%s): %s", pending.step, kind, named, action)

    def _exchange(self, digest: str, proposal: int) -> Gathered:
        self.before_exchange()
        return exchange(self._ctx, digest, proposal, self._group)

    def _nodes(self) -> list[str]:
        names = agreement.all_gather(self._ctx, agreement.Text(self._node[:200]), agreement.Text, self._group)
        return [n.text if isinstance(n.text, str) else "?" for n in names]
