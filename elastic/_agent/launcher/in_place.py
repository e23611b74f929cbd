"""Heals in place: an agent whose workers failed replaces them without a rendezvous round.

torch's agent answers any failure of its workers with `_restart_workers`: stop
them, join a new rendezvous round, start them again. A new round makes every
other agent stop its healthy workers too (they see a node waiting), so one dead
process stops the whole job (torch/distributed/elastic/agent/server/api.py,
`_invoke_run`). With `TORCHREVIVE_SURVIVORS=keep` the agent's `_restart_workers`
(elastic._agent.launcher.revive_agent) asks `InPlaceHeals.heal` first, which, for a FAILED group:

1. stops this agent's workers (torch's process context has already stopped the
   failed one's local peers; the other nodes' workers are untouched);
2. counts the heal on the rendezvous store (elastic._shared.protocol.heal_env), which gives
   the replacements their generation;
3. starts the replacements at the ranks, world size and store of the current
   round, with that generation in their environment.

The surviving workers (elastic._worker.survivors.regroup) void the step that failed, wait for
the heal's count, form the next group with the replacements and hand them their
state. Every worker of every round learns where heals meet
(`heal_env.HEAL_STORE_ENV`, `HEAL_NAMESPACE_ENV`, `HEAL_GENERATION_ENV`).

With `TORCHREVIVE_SURVIVORS=train-on` step 2 differs: the agent marks each of
its workers failed in the store (the survivors, who form a smaller group at
once, stop waiting for them) and draws the replacements' incarnation
(`heal_env.INCARNATIONS_KEY`); the replacements join the survivors at a later
step (elastic._worker.survivors.views). Workers also learn the fewest workers the job may train
with (`heal_env.MIN_WORLD_ENV`: torchrun's minimum of nodes times the workers
per node).

Invariants:
- Only a FAILED group heals in place, only while the rendezvous store is a TCP
  store (c10d), only in a job of several nodes, and only once every worker of
  the round counted itself a healer (elastic._worker.survivors.regroup): a membership change (a
  node waiting), an etcd rendezvous, a script that does not heal, a store that
  failed, or a worker that exited with `HEAL_FAILED_EXIT` (its heal's peers never
  came) takes torch's way: a new round for every worker.
- A round's heals meet in a namespace of their own (`namespace`), fixed at the
  round's first start: torch's round number is in it.
- A heal uses one of `--max-restarts`, as torch's restart would.
- What the agent writes to and reads from the store (failure marks, the
  workers' member notes) is sealed with the job's secret (`records`,
  elastic._shared.storage.store_records) and read back checked: a note that is
  not the job's, or not a count, counts as the generation the agent started
  the worker in (one warning), and a counter beyond `heal_env.MAX_GENERATION`
  is a new round, never an exception in the agent.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import torch.distributed as dist

from elastic._shared.common.errors import UsageError
from elastic._shared.protocol import heal_env
from elastic._shared.storage.peer_auth import PeerKey, SecretError
from elastic._shared.storage.sealed_store import SealedStore
from elastic._shared.storage.store_records import Records, strict_count

logger = logging.getLogger(__name__)


def mode(environ: Any) -> str:
    """TORCHREVIVE_SURVIVORS (heal_env.MODES); one `UsageError` line for another value."""
    try:
        return heal_env.mode(environ)
    except ValueError as error:
        raise UsageError(str(error)) from None


def check_setting(environ: Any, args: Any) -> str:
    """`mode`, and with `train-on` a job named by --rdzv-id (or --standalone): the checkpoint
    directory's writer, rank 0, may move to another live process of the job, which the directory's
    claim tells from another job by the run id only (torchrun's default id, "none", names no job)."""
    chosen = mode(environ)
    unnamed = (getattr(args, "rdzv_id", None) or "none") == "none" and not getattr(args, "standalone", False)
    if chosen == heal_env.TRAIN_ON and unnamed:
        raise UsageError(f"{heal_env.SURVIVORS_ENV}=train-on needs --rdzv-id naming the job (rank 0, which writes "
                         "the checkpoints, may move to another process of it)")
    return chosen


def enabled(environ: Any) -> bool:
    """Whether a failed worker is replaced in place (`keep` or `train-on`)."""
    return heal_env.mode(environ) != heal_env.RESTART if environ.get(heal_env.SURVIVORS_ENV) else False


def frozen_after(environ: Any) -> float:
    """Seconds a worker may stay stopped before it is ended and replaced (heal_env.FROZEN_AFTER_ENV)."""
    raw = environ.get(heal_env.FROZEN_AFTER_ENV, "")
    if not raw:
        return heal_env.DEFAULT_FROZEN_AFTER
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0.5 <= seconds <= 86400:
        raise UsageError(f"{heal_env.FROZEN_AFTER_ENV}={raw!r} is not a number of seconds from 0.5 to 86400")
    return seconds


class InPlaceHeals:
    """One agent's heals in place (see the module docstring), held by its agent: the round's heal
    namespace (None until the round's first start, and again once a failure took a new round), the
    generation this agent's workers start in (0 in each new round) and the agent's last look's result."""

    def __init__(self, environ: Any = None) -> None:
        self.train_on = heal_env.mode(os.environ if environ is None else environ) == heal_env.TRAIN_ON
        self.namespace: str | None = None
        self.generation = 0
        self.last_result: Any = None
        """What the agent's last look at its workers found: the failure a heal acts on."""

    def worker_env(self, worker_group: Any) -> dict[str, str]:
        """The variables a start of the workers adds to each one's environment: where heals meet, in
        which generation; none without a TCP store or a namespace (then nothing heals in place)."""
        store = heal_store(worker_group.store)
        if self.namespace is None:  # the first start of a round
            self.namespace = namespace(worker_group)
        if store is None or self.namespace is None:
            return {}
        return {
            heal_env.HEAL_STORE_ENV: address(store),
            heal_env.HEAL_NAMESPACE_ENV: self.namespace,
            heal_env.HEAL_GENERATION_ENV: str(self.generation),
            heal_env.MIN_WORLD_ENV: str(min_world(worker_group)),
        }

    def heal(self, agent: Any, worker_group: Any) -> bool:
        """Replace `agent`'s failed workers in place (True); False when this failure takes torch's new
        round, whose heals then count from 0 in a namespace of its own."""
        store = heal_store(worker_group.store)
        result, space = self.last_result, self.namespace
        if store is None or space is None or not _heals(worker_group, result, store, space) or not _heal(
            agent, self, worker_group, result, store, space
        ):
            self.generation = 0
            self.namespace = None
            return False
        return True


def heal_store(store: Any) -> SealedStore | None:
    """The sealed rendezvous store under the round's (prefixed) one, when a TCP store is under it (c10d:
    its workers reach it at `address`); None for another kind (etcd)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, SealedStore) and isinstance(store.inner, dist.TCPStore) else None


def address(store: SealedStore) -> str:
    """HOST:PORT of the TCP store under `store` (`heal_store`'s)."""
    return f"{store.inner.host}:{store.inner.port}"


def namespace(worker_group: Any) -> str | None:
    """This round's heals' namespace, the same for every agent of the round and no other round of
    the run: the run id, torch's round number and the round's worker store address. None when the
    handler is not torch's dynamic one (no round number to read): then nothing heals in place."""
    handler = worker_group.spec.rdzv_handler
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    number = getattr(state, "round", None)
    if not isinstance(number, int):
        return None
    return f"{handler.get_run_id()}/{number}/{worker_group.master_addr}:{worker_group.master_port}"


def min_world(worker_group: Any) -> int:
    """The fewest workers the job may train with: torchrun's minimum of nodes times this node's workers."""
    settings = getattr(worker_group.spec.rdzv_handler, "_settings", None)
    nodes = getattr(settings, "min_nodes", 1)
    return max(1, int(nodes) if isinstance(nodes, int) else 1) * max(1, int(worker_group.spec.local_world_size))


def _heals(worker_group: Any, result: Any, store: SealedStore, space: str) -> bool:
    """Whether a failure of this agent's workers heals in place (the module docstring's rules)."""
    from torch.distributed.elastic.agent.server.api import WorkerState

    if not (
        worker_group.state == WorkerState.FAILED
        and worker_group.group_world_size > 1  # alone, no survivor would hold the state
        and result is not None
        and bool(result.failures)
        and all(failure.exitcode != heal_env.HEAL_FAILED_EXIT for failure in result.failures.values())
    ):
        return False
    world_size = worker_group.workers[0].world_size if worker_group.workers else 0
    try:  # every worker of the round must be one that heals (elastic._worker.survivors.regroup counted it)
        healers = dist.PrefixStore(heal_env.namespace_prefix(space), store).add(heal_env.HEALERS_KEY, 0)
    except RuntimeError:
        return False  # the store failed: torch's new round says so in its own words
    return healers >= world_size > 0


def records(store: dist.Store, space: str, world_size: int, environ: Any = None) -> Records:
    """The round's records in `store` (its heal namespace), sealed with the job's secret: the file the
    keeper handed over (TORCHREVIVE_SNAPSHOT_SECRET_FILE) when there is one, else unsealed."""
    try:
        key = PeerKey.from_env(os.environ if environ is None else environ)
    except SecretError as error:
        logger.warning("heal records go unsealed: %s", error)
        key = None
    return Records(dist.PrefixStore(heal_env.namespace_prefix(space), store), key=key, scope=space,
                   world=max(world_size, 1))


def _heal(agent: Any, heals: InPlaceHeals, worker_group: Any, result: Any, store: SealedStore, space: str) -> bool:
    """Replace `agent`'s workers in place (`heals`: its state); False (nothing started) when the store failed."""
    from torch.distributed.elastic.agent.server.api import WorkerState

    ranks = ", ".join(str(rank) for rank in sorted(result.failures))
    sealed = records(store, space, worker_group.workers[0].world_size if worker_group.workers else 1)
    started_in = heals.generation
    train_on = heals.train_on
    if train_on:  # before they are stopped: the survivors stop waiting for any of this node's workers
        _mark_failed(sealed, worker_group, started_in)
    agent._stop_workers(worker_group)
    worker_group.state = WorkerState.STOPPED
    try:
        if train_on:
            generation = sealed.store.add(heal_env.INCARNATIONS_KEY, 1)
        else:
            generation = raise_generation(sealed, sorted(result.failures), started_in=started_in)
    except RuntimeError:
        return False
    if not 0 < generation <= heal_env.MAX_GENERATION:  # a counter anyone may raise
        logger.warning("the rendezvous store's heal count %d is not this job's: a new round instead", generation)
        return False
    heals.generation = generation
    print(
        f"torchrevive-run: worker rank {ranks} failed; replacing this node's workers in place "
        f"({'incarnation' if train_on else 'heal'} {generation}): the other nodes' workers keep their processes"
        + ("; its replacement joins them at a later step" if train_on else ""),
        file=sys.stderr, flush=True,
    )
    worker_ids = agent._start_workers(worker_group)
    for local_rank, worker_id in worker_ids.items():
        worker_group.workers[local_rank].id = worker_id
    worker_group.state = WorkerState.HEALTHY
    return True


def mark_workers_failed(heals: InPlaceHeals | None, worker_group: Any, environ: Any = None) -> None:
    """With train-on: note in the round's heal records that every worker of this agent failed, so the
    survivors' next view closes without waiting for them (else `views.SETTLE_SECONDS` after they arrive).
    A replacement's start does it; so does a node set aside (elastic._agent.launcher.job_watch) before
    its agent leaves. Nothing without train-on (in `environ`, default the process's), `heals` (the agent's)
    or a heal namespace; a store that fails leaves the wait."""
    if (os.environ if environ is None else environ).get(heal_env.SURVIVORS_ENV) != heal_env.TRAIN_ON:
        return
    store = heal_store(worker_group.store)
    space = heals.namespace if heals is not None else None
    if store is None or heals is None or space is None:
        return
    sealed = records(store, space, worker_group.workers[0].world_size if worker_group.workers else 1)
    _mark_failed(sealed, worker_group, heals.generation)


def _mark_failed(sealed: Records, worker_group: Any, started_in: int) -> None:
    try:
        for worker in worker_group.workers:
            sealed.set(heal_env.failed_key(heal_env.member_id(worker.global_rank, started_in)), "1")
    except RuntimeError:
        pass  # the survivors' settle time covers it (and a heal that follows fails on the store too)


def raise_generation(records: Records, failed_ranks: list[int], *, started_in: int) -> int:
    """Raise the round's generation to the one that heals `failed_ranks` (heal_env.healed_generation;
    a rank is in the generation it noted last, or in `started_in`, the one this agent started it in,
    whichever is newer: a replacement that died before it noted its first group left its predecessor's
    older note; a note that is not the job's or not a count is none) and return it. A compare-and-set loop, one
    try per agent that may move it: agents healing at once agree; 0 (no heal) when it never settles
    or the count is not one."""
    store = records.store
    failed_in = []
    for rank in failed_ranks:
        key = heal_env.member_key(rank)
        noted = records.get(key)
        generation = strict_count(noted, most=heal_env.MAX_GENERATION) if noted is not None else None
        if noted is not None and generation is None:
            records.warn_once(key, "is not a generation")
        failed_in.append(started_in if generation is None else max(generation, started_in))
    try:
        current = store.add(heal_env.GENERATION_KEY, 0)
    except ValueError:  # not a number: another process wrote it (a store error is the caller's RuntimeError)
        return 0
    for _ in range(4 * records.world + 4):
        if not 0 <= current <= heal_env.MAX_GENERATION:
            return 0
        wanted = heal_env.healed_generation(current, failed_in)
        if wanted == current:
            return current
        seen = strict_count(store.compare_set(heal_env.GENERATION_KEY, str(current), str(wanted))
                            .decode("ascii", errors="replace"), most=heal_env.MAX_GENERATION)
        if seen is None:
            return 0
        if seen == wanted:
            return wanted
        current = seen  # another agent moved it meanwhile
    return 0
