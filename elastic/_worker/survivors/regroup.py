"""Surviving a peer's death in place: leave the broken process group, form the next one
in the same process, and carry on with the state this worker already holds.

This is the worker's half of "survivors never stop" (issue 28): a worker whose
peer died keeps its process, its model, optimizer, sampler and loader workers;
only the dead worker's replacement is a new process, and it takes its state
from a survivor over the new group. torchrevive-run's agent does its half with
TORCHREVIVE_SURVIVORS=keep (elastic._agent.launcher.in_place); a DDP script calls these
pieces itself (tests/heal_worker.py is one), and `elastic.Run` through
elastic._worker.survivors.healing (with `train-on`, the groups it forms are elastic._worker.survivors.views').

How a step fails without an exception reaching the training script:
- `StepGuard.attach(ddp)` replaces DDP's gradient all-reduce with one that
  catches a failed collective (a SIGKILLed peer's closed sockets fail gloo at
  once) and marks the step void instead of raising out of `loss.backward()`.
  Its arithmetic is DDP's default one (each gradient times 1/world, then a sum),
  so with DDP's default settings a run with the guard is bit-identical to one
  without (`gradient_as_bucket_view` divides instead, which rounds differently).
  Only the gradient all-reduce is guarded: a buffer broadcast, an unused-parameter
  search or a script's own collective still raises.
- `StepGuard.guard(optimizer)` makes `optimizer.step()` a no-op on a void
  step: the parameters and the optimizer state stay those of the last step
  this rank completed.

How the next group forms (`leave`, then `rejoin`):
- A survivor lets go of the broken group as soon as its step is void (`leave`):
  its sockets close, and the peers still blocked in the collective fail at once.
- Every member (survivors and the replacement) builds the default group anew
  on a namespace of a store that outlived the dead worker (`group/<generation>`
  under the round's heal namespace), at the same rank and world size, and counts
  itself among the round's healers (the agent heals in place only when every
  worker of the round did: a script that cannot heal gets torch's new round).
- DDP's reducer is rebuilt on the new group (`rebind`): a fresh bucket layout,
  the one a new DDP starts with, so a replacement built with
  `DistributedDataParallel(..., init_sync=False)` meets the survivors bucket for bucket.

Invariants:
- A void step changed nothing this rank keeps across steps except what the
  script itself did after `optimizer.step()` (a scheduler step): the caller
  undoes that (it holds the state from before the step).
- `agree` is the first collective of a new group: every member gives the
  number of steps it completed, and learns the fewest and the most. A rank may
  be one step ahead of another (the dead peer's contribution reached it and not
  the other), never more: a step needs every rank's gradients.
- `share_state` sends the parameters, buffers and per-parameter optimizer state
  from one member to all others: a replacement, and a rank one step behind, take
  the newest state instead of recomputing it. What is not a tensor there
  (learning rates in `param_groups`, a scheduler) is the script's to carry.
- Every failure of a heal (a store that failed, a peer that never came, a
  collective that broke again) is a `RegroupError`, one line; a worker exits
  with its status (76), and its agent then holds a new round.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic._shared.common.errors import ElasticError, EnvironmentConfigError
from elastic._shared.common.errors import first_line as _first_line
from elastic._shared.protocol import heal_env
from elastic._shared.storage.peer_auth import PeerKey, SecretError
from elastic._shared.storage.store_records import Records, strict_count
from elastic._worker.survivors.heal_store import heal_store
from elastic._worker.runtime.context import shutdown_worker, teardown_pending

logger = logging.getLogger(__name__)

_POLL_S = 0.005


class RegroupError(ElasticError):
    """The members of a heal did not all come in time; the worker should exit with
    `heal_env.HEAL_FAILED_EXIT`, after which its agent starts a new round."""

    exit_code = heal_env.HEAL_FAILED_EXIT


class GroupBroken(RegroupError):
    """A collective of a newly formed group failed: a member died during the heal, which
    starts over with the next generation (the dead member's agent heals it too)."""


@dataclass(frozen=True)
class HealPoint:
    """Where this worker's heals meet (see elastic._shared.protocol.heal_env)."""

    store: dist.Store
    """The round's namespace of the rendezvous store."""
    generation: int
    """The heal this worker was started by: 0 at the start of a round (with `train-on`: its incarnation)."""
    mode: str = heal_env.KEEP
    """`heal_env.KEEP` or `heal_env.TRAIN_ON`."""
    rank: int = 0
    """This worker's rank at the round's start (torchrun's RANK)."""
    world_size: int = 1
    """The round's world size (torchrun's WORLD_SIZE)."""
    min_world: int = 1
    """With `train-on`: the fewest workers the job may train with."""
    local_rank: int = 0
    local_world_size: int = 1
    """This worker's place on its node: its agent started ranks `rank - local_rank` on, `local_world_size` of them."""
    records: Records | None = None
    """`store`'s records sealed with the job's secret (store_records); `signed_records` gives them."""

    @property
    def signed_records(self) -> Records:
        return self.records if self.records is not None else Records(self.store, world=self.world_size)


def heal_point(environ: Mapping[str, str], timeout: timedelta = timedelta(seconds=60)) -> HealPoint | None:
    """The heal point torchrevive-run gives its workers with TORCHREVIVE_SURVIVORS=keep or train-on;
    None without one. A malformed variable is an `EnvironmentConfigError` (one line)."""
    address = environ.get(heal_env.HEAL_STORE_ENV)
    if not address:
        return None
    try:  # the agent sets these variables only with a setting that heals; unset, it is `keep`'s
        mode = heal_env.mode(environ) if environ.get(heal_env.SURVIVORS_ENV) else heal_env.KEEP
    except ValueError as error:
        raise EnvironmentConfigError(str(error)) from None
    if mode == heal_env.RESTART:
        return None
    place = {}
    for name, default in (("RANK", "0"), ("WORLD_SIZE", "1"), (heal_env.MIN_WORLD_ENV, "1"), ("LOCAL_RANK", "0"),
                          ("LOCAL_WORLD_SIZE", "1")):
        raw = environ.get(name) or default
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 9):
            raise EnvironmentConfigError(f"{name}={raw!r} is not a count")
        place[name] = int(raw)
    host, _, port = address.rpartition(":")
    namespace = environ.get(heal_env.HEAL_NAMESPACE_ENV, "")
    generation = environ.get(heal_env.HEAL_GENERATION_ENV, "0")
    if not host or not (port.isascii() and port.isdigit() and len(port) <= 5) or not 0 < int(port) < 65536:
        raise EnvironmentConfigError(f"{heal_env.HEAL_STORE_ENV}={address!r} is not HOST:PORT")
    if not namespace:
        raise EnvironmentConfigError(f"{heal_env.HEAL_NAMESPACE_ENV} is not set beside {heal_env.HEAL_STORE_ENV}")
    if strict_count(generation, most=heal_env.MAX_GENERATION) is None:
        raise EnvironmentConfigError(f"{heal_env.HEAL_GENERATION_ENV}={generation!r} is not a count")
    try:  # the job's secret seals the round's records (the agent hands the workers a file: never the secret)
        key = PeerKey.from_env(environ)
    except SecretError as error:
        raise EnvironmentConfigError(str(error)) from None
    try:
        heals = heal_store(environ, host.strip("[]"), int(port), namespace, key, timeout)
    except RuntimeError as error:
        raise RegroupError(f"cannot reach the rendezvous store at {address}: {_first_line(error)}") from None
    world_size = max(place["WORLD_SIZE"], 1)
    return HealPoint(
        heals, int(generation), mode=mode,
        rank=place["RANK"], world_size=world_size, min_world=max(place[heal_env.MIN_WORLD_ENV], 1),
        local_rank=min(place["LOCAL_RANK"], place["RANK"]), local_world_size=max(place["LOCAL_WORLD_SIZE"], 1),
        records=Records(heals, key=key, scope=namespace, world=world_size),
    )


def next_generation(point: HealPoint, after: int, timeout: timedelta = timedelta(seconds=60)) -> int:
    """Wait until an agent has counted a heal past generation `after` (it has started the
    replacements by then) and return the newest count; `RegroupError` after `timeout`."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            generation = point.store.add(heal_env.GENERATION_KEY, 0)
        except RuntimeError as error:  # the rendezvous store's agent is gone
            raise RegroupError(f"the rendezvous store failed while waiting for heal {after + 1}: "
                               f"{_first_line(error)}") from None
        if generation > heal_env.MAX_GENERATION:  # a counter anyone may raise: one line, a new round
            raise RegroupError(f"the round's heal count in the rendezvous store ({generation}) is not one")
        if generation > after:
            return generation
        if time.monotonic() > deadline:
            raise RegroupError(f"no agent replaced the failed worker within {timeout} (heal {after + 1} never began)")
        time.sleep(_POLL_S)


class StepGuard:
    """Turns a failed gradient all-reduce into a void step (see the module docstring).

    `void` is set by the all-reduce of any bucket that failed and stays set until
    `clear()`: a step is void when any of its buckets failed on this rank."""

    def __init__(self) -> None:
        self.void = False
        self.error: str | None = None
        """The first failed collective's message, for the log line of the recovery."""
        self.before_reduce: Callable[[], None] = _nothing
        """Called as each bucket's all-reduce starts (a fault point: elastic._shared.protocol.fault_hook's during_all_reduce)."""

    def attach(self, model: DistributedDataParallel) -> None:
        """Reduce `model`'s gradients through this guard (again after every `rebind`)."""
        model.register_comm_hook(self, _all_reduce_or_void)

    def guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Make `optimizer.step()` do nothing while the step is void (idempotent)."""
        step = optimizer.step
        if getattr(step, "guarded_by", None) is self:
            return

        @functools.wraps(step)
        def guarded_step(*args: Any, **kwargs: Any) -> Any:
            if self.void:
                return None
            return step(*args, **kwargs)

        guarded_step.guarded_by = self  # type: ignore[attr-defined]
        optimizer.step = guarded_step  # type: ignore[method-assign]

    def failed(self, error: BaseException) -> None:
        if not self.void:
            self.error = _first_line(error)
        self.void = True

    def clear(self) -> None:
        self.void, self.error = False, None


def _all_reduce_or_void(guard, bucket):  # noqa: ANN001, ANN202 - DDP rejects a hook whose annotations are strings
    """DDP's own reduction (the bucket times 1/world, summed over ranks), a void step on failure."""
    tensor = bucket.buffer()
    if guard.void:  # an earlier bucket failed: the group is broken, do not wait on it again
        return _done(tensor)
    guard.before_reduce()
    world = dist.get_world_size()
    tensor.mul_(1.0 / world)  # DDP's default multiplies each gradient by 1/world: the same bits
    try:
        work = dist.all_reduce(tensor, async_op=True)
    except RuntimeError as error:
        guard.failed(error)
        return _done(tensor)

    def settle(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        try:
            future.value()
        except RuntimeError as error:
            guard.failed(error)
        return tensor

    return work.get_future().then(settle)


def _nothing() -> None:
    pass


def _done(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


def leave(model: DistributedDataParallel | None = None) -> None:
    """Let go of the broken group now: drop DDP's hold on it (`model`'s reducer, its logger,
    its group) and tear the default group down without waiting on a peer.

    Why at once, before waiting for the heal: a ring all-reduce's rank learns of a death only
    from its neighbours, so a rank that is not next to the dead one waits in the collective
    until a neighbour's sockets close, which happens only when the last hold on that
    neighbour's group is gone; otherwise it waits the whole collective timeout. `rebind`
    builds the reducer again."""
    if model is not None:
        model.reducer = None
        model.logger = None
        model.process_group = None
    if dist.is_initialized():
        shutdown_worker(failed=True)


def require_left(purpose: str) -> None:
    """`RegroupError` unless the last group is gone: left, and its teardown ended (one that overran
    its deadline still holds the group's sockets open, and a peer blocked on them: see
    `runtime.teardown_pending`; only this worker's exit closes them)."""
    if dist.is_initialized() or teardown_pending():
        raise RegroupError(f"the broken process group could not be left in time for {purpose} "
                           "(a collective of it still waits on a peer); leaving so that its sockets close")


def rejoin(
    store: dist.Store, *, generation: int, rank: int, world_size: int, backend: str = "gloo",
    timeout: timedelta = timedelta(minutes=5), records: Records | None = None,
) -> None:
    """Leave the current default group without waiting on a peer (it may be dead), then
    build the default group again on `store` under generation `generation`'s namespace.

    Every member of the new group calls this with the same generation; a replacement,
    which has no group yet, calls it too. Blocks until all `world_size` members joined
    (torch's own store handshake), at most `timeout`. `records`: `store`'s, sealed (default: unsealed)."""
    if dist.is_initialized():
        leave()
    require_left(f"heal {generation}")
    try:
        dist.init_process_group(
            backend, store=group_store(store, generation), rank=rank, world_size=world_size, timeout=timeout,
        )
        count_healer(records if records is not None else Records(store, world=world_size), rank=rank,
                     generation=generation)
    except RuntimeError as error:  # DistStoreError: a member never came; DistNetworkError: the store is gone
        raise RegroupError(f"rank {rank}: the group of heal {generation} did not form: {_first_line(error)}") from None


def group_store(store: dist.Store, generation: int) -> dist.Store:
    """Where the default group of heal `generation` meets (0: the round's first group)."""
    return dist.PrefixStore(f"group/{generation}", store)


def count_healer(records: Records, *, rank: int, generation: int) -> None:
    """Note that this worker joined generation `generation`'s group (a sealed record its agent reads),
    and count it among the round's healers (it turns a failed step into a void one and heals): the
    agent heals in place only when every worker of the round has counted itself."""
    records.set(heal_env.member_key(rank), str(generation))
    records.store.add(heal_env.HEALERS_KEY, 1)


def rebind(model: DistributedDataParallel, guard: StepGuard | None = None, *, reverse: bool = False) -> None:
    """Point `model` (a DDP module) at the current default group with a fresh reducer,
    as a new `DistributedDataParallel(..., init_sync=False)` would have it, and reduce
    through `guard` again. The old reducer's gradient hooks go with it.

    `reverse`: the reducer holds the parameters in reverse definition order (the order a
    sequential model's gradients become ready in), for `settle_buckets`. A reducer's order
    must be the same on every member (a bucket is the parameters' gradients end to end):
    a fresh DDP's is the definition order, so only members that all settle reverse it."""
    model.process_group = dist.group.WORLD
    parameters, expect_sparse = model._build_params_for_reducer()
    if reverse:
        parameters, expect_sparse = parameters[::-1], expect_sparse[::-1]
    model._ddp_init_helper(
        parameters, expect_sparse, model._build_debug_param_to_name_mapping(parameters), model.static_graph
    )
    if model.static_graph:  # as torch's own rebuild (DistributedDataParallel.__setstate__)
        model.reducer._set_static_graph()
        model.logger._set_static_graph()
    model._comm_hooks = []  # the old reducer's hook goes with it
    if guard is not None:
        guard.attach(model)


def settle_buckets(model: DistributedDataParallel) -> None:
    """Do now, during a heal, the one-time work a fresh reducer would do in its first two steps: a
    collective of every member of the new group, each with a `rebind(reverse=True)` reducer. Left to torch, the
    first step reduces the whole gradient as one bucket after the backward pass (nothing overlaps)
    and the second lays the buckets out again from the order the gradients came in, broadcasting
    the layout from rank 0 first. Here the buckets are laid out by size over the reducer's order
    (reverse definition order) and the layout is broadcast from rank 0 now, so the steps
    after the heal run a steady step's all-reduces and nothing else. A reducer that never rebuilds
    (`find_unused_parameters`) or a static graph (its first step records the graph) is left as it
    is, on every member alike."""
    reducer = model.reducer
    if model.static_graph or reducer is None:
        return
    reducer._push_all_rebuilt_params()  # (nothing when the reducer does not rebuild its buckets)
    reducer._rebuild_buckets()


@dataclass(frozen=True)
class Agreement:
    """What the members of a new group learned of each other's progress."""

    fewest: int
    """The fewest steps a member completed (a replacement counts what it restored: maybe 0)."""
    most: int
    """The most steps a member completed: where the group carries on from."""
    source: int
    """The lowest rank that completed `most` steps: it shares its state (`share_state`)."""


def agree(completed: int) -> Agreement:
    """Every member's completed steps, combined in one collective (the first of a new group)."""
    votes = ballot(completed, rank=dist.get_rank(), world_size=dist.get_world_size())
    try:
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)
    except RuntimeError as error:
        raise GroupBroken(f"the new group broke while its members compared steps: {_first_line(error)}") from None
    return count(votes, world_size=dist.get_world_size())


def ballot(completed: int, *, rank: int, world_size: int) -> torch.Tensor:
    """One member's vote; the element-wise MAX of all votes is read by `count`. The largest
    `completed * world_size + (world_size - 1 - rank)` names the most steps and, among the
    members that completed them, the lowest rank; the largest `-completed` the fewest steps."""
    return torch.tensor([-completed, completed * world_size + (world_size - 1 - rank)], dtype=torch.int64)


def count(votes: torch.Tensor, *, world_size: int) -> Agreement:
    most, lowest = divmod(int(votes[1]), world_size)
    return Agreement(fewest=-int(votes[0]), most=most, source=world_size - 1 - lowest)


def share_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, src: int) -> None:
    """Make every member's parameters, buffers and per-parameter optimizer state equal to
    rank `src`'s (collectives). A member whose optimizer has no state yet (a replacement)
    makes it first (`prepare_optimizer_state`) when the source has some; when the source has
    none (no step taken, or an optimizer without state), only the model is sent."""
    try:
        source_has_state = torch.tensor([int(bool(optimizer.state))], dtype=torch.int64)
        dist.broadcast(source_has_state, src)
        if source_has_state.item() and not optimizer.state:
            prepare_optimizer_state(optimizer)
        for tensor in _state_tensors(model, optimizer if source_has_state.item() else None):
            dist.broadcast(tensor, src)
    except RuntimeError as error:
        raise GroupBroken(f"the new group broke while rank {src} shared its state: {_first_line(error)}") from None


def prepare_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its per-parameter state, so that `share_state` can fill it:
    one step on zero gradients makes the state (its keys and shapes are the optimizer's
    own), then the parameters are put back (weight decay moved them)."""
    saved = [(p, p.grad) for group in optimizer.param_groups for p in group["params"]]
    originals = [p.detach().clone() for p, _ in saved]
    for p, _ in saved:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    with torch.no_grad():
        for (p, grad), original in zip(saved, originals):
            p.copy_(original)
            p.grad = grad


def _state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor a member must hold equal to the source's, in an order all members share."""
    tensors = [t.data for t in model.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)]
    for group in optimizer.param_groups if optimizer is not None else ():
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            tensors += [state[key] for key in sorted(state) if isinstance(state[key], torch.Tensor)]
    return tensors
